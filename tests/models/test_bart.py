"""BART, and BERT / RoBERTa as cross-attention decoders, against single-process ``transformers`` (fp32, atol 1e-5).

In this process (tp 1): every BART class (logits or outputs, loss and every gradient) on a batch with padding in
the encoder AND the decoder, scaled embeddings and a non-zero ``final_logits_bias``; activation checkpointing;
``save_pretrained`` -> plain ``transformers``; ``generate`` greedy, sampled and with 3 beams, token for token;
``BertLMHeadModel`` and ``RobertaForCausalLM`` with ``add_cross_attention`` (logits, loss, gradients, and a decode
loop over an ``EncoderDecoderCache``).

One spawned group of 4 ranks (``tests/helpers/layouts.py``, ``tests/helpers/pipeline.py``), one AdamW step per
layout: BART at tp 2 + SP x dp 2 under ZeRO-3, then on its trained sharded weights ``generate`` greedy / sampled /
3 beams; tp 4; pp 2 x tp 2 cut inside the encoder and across encoder and decoder; BERT's cross-attention decoder at
tp 2 + SP x dp 2, then its cached decode loop at tp 2. Context parallelism is refused for BART.

In the same group, the 2D grid (tp 4 as a 2 x 2 grid, batch split in 2 blocks, hidden in 2): BART 3 AdamW steps
(the grid head's vocabulary columns get their slice of ``final_logits_bias``; learned positions keep their offset
2), then ``save_pretrained`` -> plain ``transformers`` (``final_logits_bias`` saved whole) gives the trained
reference's logits; ``BartModel``'s outputs; ``BartForCausalLM`` with cross-attention over a given
``encoder_hidden_states`` (split at the grid boundary like ``inputs_embeds``). Broken on purpose, each fails here:
the bias sliced from column 0 on every rank; the grid's learned positions without the offset;
``encoder_hidden_states`` not split at the boundary. Its 2D ``generate`` is in ``test_seq2seq_grid_generate.py``,
2.5D / 3D there too (slow).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.common.attention.cache_names import cache_kwargs
from tests.helpers import encoders
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_grads_match
from tests.helpers.pipeline import assert_pipeline_matches
from tests.helpers.zoo import tiny_config, tiny_kwargs

CLASSES = ("BartModel", "BartForConditionalGeneration", "BartForSequenceClassification",
           "BartForQuestionAnswering", "BartForCausalLM")
single_thread = encoders.single_thread  # a fixture: in-process runs use one thread, as the spawned ranks
PAD, EOS = tiny_kwargs("bart")["pad_token_id"], tiny_kwargs("bart")["eos_token_id"]


def _save(root, name: str, **overrides) -> str:
    """``transformers``' ``name`` from seed 0 (a non-zero ``final_logits_bias`` where the class has one)."""
    torch.manual_seed(0)
    model = getattr(transformers, name)(tiny_config("bart", **overrides))
    if hasattr(model, "final_logits_bias"):
        with torch.no_grad():
            model.final_logits_bias.normal_()
    model.save_pretrained(root / name)
    return str(root / name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("bart")
    paths = {name: _save(root, name) for name in CLASSES}
    paths["pp"] = _save(root / "pp", "BartForConditionalGeneration", encoder_layers=3, decoder_layers=1)
    paths["bert"] = _save_bert(root / "bert")
    paths["roberta"] = _save_bert(root / "roberta", "roberta")
    return paths


def _batch(rows: int = 4, enc: int = 8, dec: int = 4) -> dict:
    """Right padding in the encoder (rows 1.., shorter) and the decoder (the last row); one ``<eos>`` per encoder
    row at its last token (what the classification head pools)."""
    gen = torch.Generator().manual_seed(1)
    lengths = [enc - (row % 3) * 2 for row in range(rows)]
    mask = (torch.arange(enc)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 101, (rows, enc), generator=gen).masked_fill(mask == 0, PAD)
    ids[torch.arange(rows), torch.tensor(lengths) - 1] = EOS
    dec_mask = torch.ones(rows, dec, dtype=torch.long)
    dec_mask[-1, dec // 2:] = 0
    labels = torch.randint(3, 101, (rows, dec), generator=gen).masked_fill(dec_mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, decoder_attention_mask=dec_mask, labels=labels)


def _call(name: str, batch: dict) -> dict:
    """Each class's inputs and targets from the seq2seq batch."""
    rows = batch["input_ids"].shape[0]
    if name == "BartForCausalLM":  # the decoder alone, attending to an encoder output with padding
        encoder = torch.randn(rows, 6, 32, generator=torch.Generator().manual_seed(2))
        return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100),
                    encoder_hidden_states=encoder, encoder_attention_mask=batch["attention_mask"][:, :6])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_attention_mask")}
    inputs["decoder_input_ids"] = batch["labels"].masked_fill(batch["labels"] == -100, PAD)
    if name == "BartForConditionalGeneration":
        return dict(batch)
    if name == "BartForSequenceClassification":  # the decoder reads input_ids shifted right, pools its <eos>
        return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    decoder_attention_mask=batch["attention_mask"], labels=torch.arange(rows) % 3)
    if name == "BartForQuestionAnswering":
        return dict(inputs, start_positions=torch.arange(rows) % 4, end_positions=torch.arange(rows) % 4 + 1)
    return inputs


def _loss(name: str, outputs) -> torch.Tensor:
    return (outputs.last_hidden_state ** 2).mean() if name == "BartModel" else outputs.loss


def _outputs(name: str, outputs) -> list:
    keys = {"BartModel": ["last_hidden_state", "encoder_last_hidden_state"],
            "BartForQuestionAnswering": ["start_logits", "end_logits"]}.get(name, ["logits"])
    return [outputs[key] for key in keys]


def _check_class(name: str, path: str, *, checkpointing: bool = False) -> None:
    reference = getattr(transformers, name).from_pretrained(path).train()
    model = getattr(om, name).from_pretrained(path, progress=False).train()
    assert type(model).__name__ == name
    if checkpointing:
        enable_checkpointing(model)
    call = _call(name, _batch())
    expected, got = reference(**call), model(**call)
    for a, b in zip(_outputs(name, got), _outputs(name, expected)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_loss(name, got), _loss(name, expected), atol=1e-5, rtol=1e-5)
    _loss(name, expected).backward(), _loss(name, got).backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


@pytest.mark.parametrize("name", CLASSES)
def test_tp1_every_class_matches_transformers(name, checkpoints, single_thread):
    _check_class(name, checkpoints[name])


def test_activation_checkpointing_save_and_generate(checkpoints, tmp_path, single_thread):
    path = checkpoints["BartForConditionalGeneration"]
    _check_class("BartForConditionalGeneration", path, checkpointing=True)
    model = om.BartForConditionalGeneration.from_pretrained(path, progress=False).eval()
    reference = transformers.BartForConditionalGeneration.from_pretrained(path).eval()
    assert model.lm_head.weight is model.model.shared.weight is model.model.encoder.embed_tokens.weight
    # save -> plain transformers: the same keys (final_logits_bias included) and logits
    model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.BartForConditionalGeneration.from_pretrained(tmp_path / "saved").eval()
    assert set(reloaded.state_dict()) == set(reference.state_dict())
    call = {k: v for k, v in _batch().items() if k != "labels"}
    call["decoder_input_ids"] = _call("BartModel", _batch())["decoder_input_ids"]
    with torch.no_grad():
        expected = reference(**call).logits
        torch.testing.assert_close(reloaded(**call).logits, expected, atol=1e-5, rtol=1e-5)
        # negative control: without its final_logits_bias the model does not match transformers
        model.final_logits_bias.zero_()
        assert not torch.allclose(model(**call).logits, expected, atol=1e-3)
    _check_generate(om.BartForConditionalGeneration.from_pretrained(path, progress=False), reference)


def _check_generate(model, reference) -> None:
    """Greedy, sampled and 3-beam ``generate`` on a padded batch, token for token."""
    model.eval(), reference.eval()
    batch = _batch(rows=2)
    common = dict(attention_mask=batch["attention_mask"], max_new_tokens=5, min_new_tokens=5)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3),
                    dict(do_sample=True, top_k=20, temperature=0.8)):
        torch.manual_seed(11)
        theirs = reference.generate(batch["input_ids"], **common, **options)
        torch.manual_seed(11)
        assert torch.equal(model.generate(batch["input_ids"], **common, **options), theirs), options


def test_context_parallel_and_grid_modes_are_refused():
    """Before any process group: BERT's cross-attention decoder refuses context parallelism and the grid
    tensor-parallel modes (BART's seq2seq LM runs under cp: ``test_bart_context_parallel.py``; its pooling heads are
    refused by their capabilities)."""
    parallel = om.ParallelConfig(context_parallel_size=2)
    om.BartForConditionalGeneration.validate_parallel_config(tiny_config("bart"), parallel)
    from oslo_models.models.common.stack.context_parallel import check_context_parallel

    check_context_parallel(om.BartForConditionalGeneration, tiny_config("bart"), parallel)
    with pytest.raises(NotImplementedError, match="BartForSequenceClassification under context_parallel_size=2"):
        check_context_parallel(om.BartForSequenceClassification, tiny_config("bart"), parallel)
    for parallel in (parallel, om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d")):
        with pytest.raises(NotImplementedError, match="with cross-attention"):
            om.BertLMHeadModel.validate_parallel_config(_bert_config(), parallel)


# ---------------------------------------------------------------------------------------------- BERT decoder
DECODERS = {"bert": "BertLMHeadModel", "roberta": "RobertaForCausalLM"}


def _bert_config(model_type: str = "bert"):
    return tiny_config(model_type, is_decoder=True, add_cross_attention=True)


def _save_bert(path, model_type: str = "bert") -> str:
    torch.manual_seed(0)
    getattr(transformers, DECODERS[model_type])(_bert_config(model_type)).save_pretrained(path)
    return str(path)


def _bert_batch(rows: int = 4) -> dict:
    """Right-padded decoder inputs, and an encoder output ``[b, 6, h]`` whose rows have unequal padding."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 101, (rows, 8), generator=gen)  # no pad id (0 for BERT, 1 for RoBERTa) inside
    mask = torch.ones(rows, 8, dtype=torch.long)
    mask[1::2, 6:] = 0
    encoder_mask = torch.ones(rows, 6, dtype=torch.long)
    encoder_mask[2:, 4:] = 0
    return dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask,
                labels=ids.masked_fill(mask == 0, -100), encoder_attention_mask=encoder_mask,
                encoder_hidden_states=torch.randn(rows, 6, 32, generator=gen))


def _check_bert_decode_loop(model, reference) -> None:
    """Prefill 5 tokens, then 3 one-token steps over ``EncoderDecoderCache``s (cross keys cached at step one)."""
    model.eval(), reference.eval()
    batch = _bert_batch(rows=2)
    ids, encoder = batch["input_ids"], dict(encoder_hidden_states=batch["encoder_hidden_states"],
                                            encoder_attention_mask=batch["encoder_attention_mask"])
    caches = [transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
              for _ in range(2)]
    with torch.no_grad():
        for start, stop in [(0, 5), (5, 6), (6, 7), (7, 8)]:
            expected = reference(ids[:, start:stop], **cache_kwargs(caches[0]), use_cache=True, **encoder).logits
            got = model(ids[:, start:stop], past_key_values=caches[1], use_cache=True, **encoder).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m, s=start: f"step {s}: {m}")


@pytest.mark.parametrize("model_type", DECODERS)
def test_cross_attention_decoder_tp1(model_type, checkpoints, single_thread):
    path, name = checkpoints[model_type], DECODERS[model_type]
    reference = getattr(transformers, name).from_pretrained(path).train()
    model = getattr(om, name).from_pretrained(path, progress=False).train()
    batch = _bert_batch()
    expected, got = reference(**batch), model(**batch)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))
    _check_bert_decode_loop(model, reference)


# ---------------------------------------------------------------------------------------------- 4 ranks
def _layouts_worker(paths: dict, out_dir: str) -> None:
    cg = "BartForConditionalGeneration"
    _grid_2d(paths, out_dir)

    def reference(path=paths[cg], cls=transformers.BartForConditionalGeneration):
        return cls.from_pretrained(path).train()

    def model(layout, path=paths[cg], cls=om.BartForConditionalGeneration):
        return cls.from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False).train()

    # then generate on the trained ZeRO-3 model (it calls the encoder directly, outside the root's unsharding hook)
    # shift_labels=False: BART's labels are the decoder's targets as they are (the global batch's label count)
    _check_generate(*train_matches(model(dict(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2)),
                                   reference(), _batch(), zero_stage=3, shift_labels=False))
    train_matches(model(dict(tensor_parallel_size=4)), reference(), _batch(), shift_labels=False)
    # 3 encoder layers + 1 decoder layer in 2 stages: stage 0 = encoder 0-1, stage 1 = encoder 2 and the decoder
    pipelined = model(dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2), path=paths["pp"])
    assert_pipeline_matches(pipelined, reference(paths["pp"]), _batch(), steps=1)
    # the other heads at pp 2 x tp 2 (cut between encoder and decoder): sequence classification on the last <eos>
    # (its decoder reads input_ids shifted right), QA on given decoder inputs (4 long: positions index them, 9 is
    # past them: ignored)
    for name in ("BartForSequenceClassification", "BartForQuestionAnswering"):
        batch = _call(name, _batch())
        if name == "BartForQuestionAnswering":
            batch.update(start_positions=torch.tensor([0, 1, 2, 9]), end_positions=torch.tensor([1, 3, 2, 9]))
        head = model(dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2), path=paths[name],
                     cls=getattr(om, name))
        assert_pipeline_matches(head, reference(paths[name], getattr(transformers, name)), batch, steps=1)
    # BERT as a cross-attention decoder: tp 2 + SP x dp 2, then its cached decode loop at tp 2
    bert = model(dict(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2), path=paths["bert"],
                 cls=om.BertLMHeadModel)
    pair = train_matches(bert, reference(paths["bert"], transformers.BertLMHeadModel), _bert_batch())
    _check_bert_decode_loop(*pair)


def _grid_2d(paths: dict, out_dir: str) -> None:
    """See the module docstring: BART at 2D, 3 steps, save -> plain transformers; its decoder alone as a causal LM
    with cross-attention."""
    grid = om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d")
    path = paths["BartForConditionalGeneration"]
    model = om.BartForConditionalGeneration.from_pretrained(path, parallel=grid, progress=False).train()
    model, reference = train_matches(model, transformers.BartForConditionalGeneration.from_pretrained(path).train(),
                                     _batch(), steps=3, shift_labels=False)
    model.save_pretrained(out_dir)
    model.parallel_context.barrier()
    reloaded = transformers.BartForConditionalGeneration.from_pretrained(out_dir).eval()
    call = {k: v for k, v in _batch().items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**call).logits, reference.eval()(**call).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reloaded.final_logits_bias, reference.final_logits_bias, atol=0, rtol=0)
    base = om.BartModel.from_pretrained(paths["BartModel"], parallel=grid, progress=False).eval()
    call = _call("BartModel", _batch())
    with torch.no_grad():  # the base model's outputs come back [b, s, d] at the boundary
        for a, b in zip(_outputs("BartModel", base(**call)),
                        _outputs("BartModel", transformers.BartModel.from_pretrained(paths["BartModel"])(**call))):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    name = "BartForCausalLM"
    model = om.BartForCausalLM.from_pretrained(paths[name], parallel=grid, progress=False).train()
    train_matches(model, transformers.BartForCausalLM.from_pretrained(paths[name]).train(), _call(name, _batch()),
                  shift_labels=False)


def test_layouts_match_transformers(checkpoints, tmp_path):
    run_distributed(_layouts_worker, 4, checkpoints, str(tmp_path / "grid_saved"))
