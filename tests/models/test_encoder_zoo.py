"""The encoder zoo: one parity test over every family record with a masked-LM head (BERT, RoBERTa, DistilBERT,
ELECTRA, ALBERT, ...), each on its record's tiny model, which exercises the family's particulars (ALBERT: 4 layers
run by 2 shared layer groups of 2 inner layers and 16-wide factorized embeddings; ELECTRA: 16-wide embeddings and
``embeddings_project``; DistilBERT: its own module names, no token types, sinusoidal position table).

Against the single-process ``transformers`` twin built from the same weights:

- tp=1 in this process: the masked LM's logits, loss and every gradient on a right-padded batch (with token types
  where the type has them), also with activation checkpointing (every block recomputed);
  ``save_pretrained`` -> plain ``transformers`` (same keys and logits); every other head of
  the record (sequence and token classification, question answering, multiple choice, pre-training: BERT's NSP,
  ELECTRA's discriminator, ALBERT's sentence order) for one forward and backward;
- one spawned group of 4 ranks, one AdamW step per layout (``tests/helpers/layouts.py``; the pipeline:
  ``tests/helpers/pipeline.py``): tp=2 with sequence parallelism x dp=2 under ZeRO-3 through ``om.training.prepare``,
  tp=4, the 2D mode on a 2 x 2 grid, pp=2 x tp=2 (1F1B, 2 microbatches), context parallelism (all-to-all) x dp=2
  under ZeRO-1 (with position ids given, as context parallelism asks of RoBERTa); ELECTRA's discriminator at tp=2
  with sequence parallelism too.

A layout the validation code refuses (before any process group) must be one ``REFUSED`` lists for the type, with its
reason; every other layout must run and match. Variants that are another record's classes under another name
(XLM-RoBERTa, CamemBERT: RoBERTa's) are left out.
"""
from __future__ import annotations

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

import oslo_models as om
from oslo_models.conversion.checkpoint import InMemoryReader
from oslo_models.models.common.stack.context_parallel import check_context_parallel
from oslo_models.models.encoder_heads import ForMaskedLM
from oslo_models.models.registry import families, family_record
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import single_thread  # noqa: F401 (a fixture)
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.pipeline import assert_pipeline_matches
from tests.helpers.zoo import tiny_config

# The layouts the validation code refuses for a type, with a fragment of the reason.
REFUSED = {"deberta-v2": {"cp2 all_to_all x dp2 zero1": "relative (c2p / p2c) attention terms need every key's",
                          "2d tp4": "the relative-embedding table its attention projects"},
           "modernbert": {"2d tp4": "no grid plan"}}
# ALBERT's 4 layers run groups 0, 0, 1, 1: cut after layer 0, group 0 runs on both stages (its copies' gradients
# summed across them) and group 1 on the last only
PIPELINE = {"albert": dict(pipeline_partition=(1, 3))}
# The heads run at pp2 x tp2 per family (each one more 4-rank build and step: CI time): every rule of
# common/loss/head_rules.py once (DistilBERT's first-token classifier, ELECTRA's own classifier module, token
# classification, QA) on a family that needs it; BERT's sequence classification runs in tests/models/test_bert_parity.py
PIPELINE_HEADS = {"bert": ("multiple_choice",),  # BERT's pooler (RoBERTa's too)
                  "distilbert": ("sequence_classification", "question_answering", "multiple_choice"),
                  "electra": ("sequence_classification", "token_classification", "multiple_choice"),
                  "albert": ("question_answering", "multiple_choice"),
                  # DeBERTa's pooled heads (ContextPooler, its loss rule) and QA; its token classification is the
                  # same adapter on the same stages (CI time)
                  "deberta-v2": ("sequence_classification", "question_answering", "multiple_choice")}
HEAD_TASKS = ("sequence_classification", "token_classification", "question_answering", "multiple_choice",
              "pretraining")


def _encoder_types() -> list[str]:
    """Records whose masked LM is an encoder head, less the variants (a masked LM subclassing another record's)."""
    records = [r for r in families() if "masked_lm" in r.classes and issubclass(r.model_class("masked_lm"),
                                                                               ForMaskedLM)]
    mlm = {r.model_type: r.model_class("masked_lm") for r in records}
    return [t for t, cls in mlm.items()
            if not any(cls is not other and issubclass(cls, other) for other in mlm.values())]


def _om_class(model_type: str, task: str = "masked_lm") -> type:
    return family_record(model_type).model_class(task)


def _batch(config, rows: int = 4, seq: int = 16) -> dict:
    """Right-padded rows with the type's padding token on padding; token types (second half 1) where the type has
    them; labels on every other real token."""
    ids, mask, labels = padded_batch(config.vocab_size, batch=rows, seq=seq)
    pad = config.pad_token_id
    ids = ids.masked_fill(ids == pad, 5).masked_fill(mask == 0, pad)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(torch.arange(seq) % 2 == 1, -100))
    if getattr(config, "type_vocab_size", 0) > 1:
        batch["token_type_ids"] = (torch.arange(seq) >= seq // 2).long().expand(rows, seq) * mask
    return batch


def _save_reference(model_type: str, folder) -> str:
    torch.manual_seed(0)
    _om_class(model_type).hf_twin(tiny_config(model_type)).save_pretrained(folder)
    return str(folder)


def _reference(model_type: str, path: str, task: str = "masked_lm"):
    return _om_class(model_type, task).hf_twin.from_pretrained(path).train()


def _assert_outputs_match(got, expected) -> None:
    """Every tensor ``transformers`` returned (logits of each head, loss), then every gradient after backward."""
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def _check_mlm_and_save(model_type: str, path: str, folder) -> None:
    model = _om_class(model_type).from_pretrained(path, progress=False).train()
    reference = _reference(model_type, path)
    assert type(model).__name__ == type(reference).__name__
    batch = _batch(reference.config, rows=3, seq=8)
    expected, got = reference(**batch), model(**batch)
    _assert_outputs_match(got, expected)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))
    # save_pretrained -> plain transformers: the same keys and logits
    model.save_pretrained(folder)
    reloaded = type(reference).from_pretrained(folder).eval()
    assert set(reloaded.state_dict()) == set(reference.state_dict())
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, reference.eval()(**batch).logits, atol=1e-5, rtol=1e-4)


def _check_activation_checkpointing(model_type: str, path: str) -> None:
    """``gradient_checkpointing_enable``: every block recomputed in backward, the same loss and gradients."""
    model = _om_class(model_type).from_pretrained(path, progress=False).train()
    enable_checkpointing(model)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers), model_type
    reference = _reference(model_type, path)
    batch = _batch(reference.config, rows=3, seq=8)
    expected, got = reference(**batch), model(**batch)
    _assert_outputs_match(got, expected)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def _head_inputs(task: str, config) -> dict:
    batch = _batch(config, rows=2, seq=8)
    labels = batch.pop("labels")
    if task == "sequence_classification":
        return dict(batch, labels=torch.tensor([0, 2]))
    if task == "token_classification":
        return dict(batch, labels=torch.where(labels == -100, labels, labels % 3))
    if task == "question_answering":
        return dict(batch, start_positions=torch.tensor([1, 3]), end_positions=torch.tensor([2, 9]))
    if task == "multiple_choice":  # [b, c, s]: the same rows as 3 choices
        return dict({key: value[:, None].expand(-1, 3, -1).contiguous() for key, value in batch.items()},
                    labels=torch.tensor([0, 2]))
    order = {"bert": "next_sentence_label", "albert": "sentence_order_label"}  # pre-training's second target
    if config.model_type == "electra":  # the discriminator: 1 where a token was replaced
        return dict(batch, labels=(batch["input_ids"] % 2))
    return dict(batch, labels=labels, **{order[config.model_type]: torch.tensor([0, 1])})


def _check_heads(model_type: str) -> None:
    """Each other head of the record, tp=1: every output tensor, the loss and every gradient."""
    for task in HEAD_TASKS:
        if task not in family_record(model_type).classes:
            continue
        om_class = _om_class(model_type, task)
        config = tiny_config(model_type, num_labels=2 if task in ("question_answering", "pretraining") else 3)
        torch.manual_seed(1)
        reference = om_class.hf_twin(config).train()
        model = om_class(config).train()
        model.load_from_reader(InMemoryReader(reference.state_dict()))
        assert type(model).__name__ == type(reference).__name__
        inputs = _head_inputs(task, config)
        expected, got = reference(**inputs), model(**inputs)
        _assert_outputs_match(got, expected)
        expected.loss.backward(), got.loss.backward()
        assert assert_grads_match(model, reference) == len(list(model.parameters())), task


def _refusal(om_class, config, **layout) -> str | None:
    parallel = om.ParallelConfig(**layout)
    try:
        om_class.validate_parallel_config(config, parallel)
        check_context_parallel(om_class, config, parallel)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def _check_albert_pipeline(model, path: str, layout: dict) -> None:
    """ALBERT at pp2 x tp2 with group 0 on both stages: 3 AdamW steps equal transformers' (loss, every gradient,
    every parameter); the shared copies saved once -> plain transformers holds the reference's trained weights.
    Negative control: a fresh model whose shared copies' gradients are not summed across the stages mismatches."""
    import torch.distributed as dist

    reference = _reference("albert", path)
    batch = _batch(reference.config, seq=8)
    names = {id(param): name for name, param in model.named_parameters()}
    tied = [names[id(param)] for param, _ in model._pipeline_runner().tied.groups]
    # every parameter of group 0's 2 inner layers, on both ranks (+ the tied word embeddings / decoder)
    assert sum("albert_layer_groups.0." in name for name in tied) == 2 * 16, tied
    assert_pipeline_matches(model, reference, batch, steps=3)
    folder = path + "-pp"
    model.save_pretrained(folder)
    dist.barrier()
    if dist.get_rank() == 0:
        saved = type(reference).from_pretrained(folder)
        expected = reference.state_dict()
        assert set(saved.state_dict()) == set(expected)
        for key, value in saved.state_dict().items():
            torch.testing.assert_close(value, expected[key], atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
    broken = _om_class("albert").from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False).train()
    runner, names = broken._pipeline_runner(), {id(param): name for name, param in broken.named_parameters()}
    runner.tied.groups = [(param, group) for param, group in runner.tied.groups
                          if "albert_layer_groups" not in names[id(param)]]
    reference = _reference("albert", path)
    reference(**batch).loss.backward()
    broken.train_step(_batch(reference.config, seq=8))
    with pytest.raises(AssertionError, match="albert_layer_groups.0"):
        assert_grads_match(broken, reference)


def _pipeline_heads(model_type: str, root) -> dict[str, str]:
    """Saved tiny checkpoints of the record's classification / QA heads that have pipeline stages."""
    paths = {}
    for task in PIPELINE_HEADS.get(model_type, ()):
        if task in family_record(model_type).classes and _om_class(model_type, task).pipeline_adapter is not None:
            torch.manual_seed(3)
            config = tiny_config(model_type, num_labels=2 if task == "question_answering" else 3)
            paths[task] = str(root / task)
            _om_class(model_type, task).hf_twin(config).save_pretrained(paths[task])
    return paths


def _check_pipeline_heads(model_type: str, heads: dict[str, str], layout: dict) -> None:
    """Each head with pipeline stages at the pp layout: one AdamW step equal to transformers' (loss, every gradient
    and parameter); QA's positions become the adapter's labels."""
    for task, path in heads.items():
        model = _om_class(model_type, task).from_pretrained(path, parallel=om.ParallelConfig(**layout),
                                                           progress=False).train()
        reference = _reference(model_type, path, task)
        batch = _batch(reference.config, seq=8)
        labels = batch.pop("labels")
        if task == "multiple_choice":  # [b, c, s]: each row with 3 different choices (rolled tokens)
            batch = {key: torch.stack([value.roll(c, dims=-1) if key == "input_ids" else value for c in range(3)],
                                      dim=1) for key, value in batch.items()}
        targets = {"sequence_classification": dict(labels=torch.tensor([0, 2, 1, 0])),
                   "token_classification": dict(labels=torch.where(labels == -100, labels, labels % 3)),
                   "question_answering": dict(start_positions=torch.tensor([1, 3, 0, 2]),
                                              end_positions=torch.tensor([2, 7, 5, 4])),
                   "multiple_choice": dict(labels=torch.tensor([2, 0, 1, 2]))}[task]
        assert_pipeline_matches(model, reference, dict(batch, **targets), steps=1)
        if task == "multiple_choice" and model_type == "bert":
            _check_choices_grouping_matters(path, layout, dict(batch, **targets))


def _check_choices_grouping_matters(path: str, layout: dict, batch: dict) -> None:
    """Negative control of the multiple-choice stages: scores grouped choice-major (``[c, mb]`` transposed: each
    question's scores taken from other questions' rows) instead of question-major give another loss."""
    from oslo_models.models.common.loss.head_rules import MultipleChoiceRule

    class ChoiceMajor(MultipleChoiceRule):
        def loss(self, model, logits, labels, num_items_in_batch):
            return super().loss(model, logits.view(-1, labels.shape[0]).t().reshape(-1, 1), labels,
                                num_items_in_batch)

    om_class = _om_class("bert", "multiple_choice")
    broken = type(om_class.__name__, (om_class,), {"head_rule": ChoiceMajor()})
    model = broken.from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False).train()
    expected = _reference("bert", path, "multiple_choice")(**batch).loss
    assert not torch.allclose(model.train_step(batch), expected.detach(), atol=1e-3)


def _check_albert_zero_pipeline(path: str, one_group_path: str) -> None:
    """ZeRO-3 x pp 2 x dp 2: refused by ``prepare`` (every rank alike, before any collective) where a rank runs a
    shared group at several depths (the zoo's 4 layers over 2 groups); accepted, and 2 AdamW steps equal to
    transformers, where each rank runs the one group once (2 layers, 1 group: its copies on both ranks sharded over
    dp, their gradient shards summed across the stages). A batch without padding: every replica holds as many
    labelled tokens, so the replicas' mean is the whole batch's."""
    from accelerate import Accelerator
    from oslo_models import training
    from tests.helpers.pipeline import ADAMW

    layout = dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    model = _om_class("albert").from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False)
    with pytest.raises(ValueError, match=r"runs the shared layer group\(s\) \[0\] at several depths"):
        training.prepare(Accelerator(cpu=True), model, torch.optim.AdamW(model.parameters()), zero_stage=3)
    model = _om_class("albert").from_pretrained(one_group_path, parallel=om.ParallelConfig(**layout, zero_stage=3),
                                                progress=False).train()
    model, optimizer = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW))
    ids = torch.randint(5, 100, (4, 8), generator=torch.Generator().manual_seed(0))
    assert_pipeline_matches(model, _reference("albert", one_group_path), dict(input_ids=ids, labels=ids),
                            optimizer=optimizer, steps=2)


def _layouts_worker(model_type: str, path: str, discriminator_path: str | None, heads: dict[str, str],
                    one_group_path: str | None = None) -> None:
    """Four ranks, one AdamW step per layout against transformers on the whole batch; a refused layout is recorded
    with its reason (every rank takes the same decisions: they depend on the config only)."""
    om_class, config = _om_class(model_type), tiny_config(model_type)
    refused = {}

    def run(name: str, zero_stage: int = 0, batch=None, **layout):
        if (reason := _refusal(om_class, config, **layout)) is not None:
            refused[name] = reason
            return
        model = om_class.from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False).train()
        if model_type == "albert" and layout.get("pipeline_parallel_size", 1) > 1:
            _check_albert_pipeline(model, path, layout)
        elif layout.get("pipeline_parallel_size", 1) > 1:
            assert_pipeline_matches(model, _reference(model_type, path), _batch(config, seq=8), steps=1)
        if layout.get("pipeline_parallel_size", 1) > 1:
            _check_pipeline_heads(model_type, heads, layout)
        else:
            train_matches(model, _reference(model_type, path), batch or _batch(config), zero_stage=zero_stage,
                          shift_labels=False)

    run("tp2+sp x dp2 zero3", 3, tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2)
    run("tp4", tensor_parallel_size=4)
    run("2d tp4", tensor_parallel_size=4, tensor_parallel_mode="2d")  # Optimus on a 2 x 2 grid
    run("pp2 x tp2", pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2,
        **PIPELINE.get(model_type, {}))
    positions = torch.arange(16).expand(4, 16)  # given: RoBERTa cannot derive them from one chunk
    run("cp2 all_to_all x dp2 zero1", 1, batch=dict(_batch(config), position_ids=positions),
        context_parallel_size=2, context_parallel_mode="all_to_all", data_parallel_size=2)
    if one_group_path is not None:
        _check_albert_zero_pipeline(path, one_group_path)
    expected = REFUSED.get(model_type, {})
    assert set(refused) == set(expected), (model_type, refused)
    for name, why in expected.items():
        assert why in refused[name], (model_type, name, refused[name])
    if discriminator_path is not None:  # ELECTRA's discriminator checkpoint: its per-token head under tp + sp
        parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2)
        model = _om_class(model_type, "pretraining").from_pretrained(discriminator_path, parallel=parallel,
                                                                      progress=False).train()
        batch = _batch(config)
        batch["labels"] = batch["input_ids"] % 2
        train_matches(model, _reference(model_type, discriminator_path, "pretraining"), batch, shift_labels=False)


@pytest.mark.parametrize("model_type", _encoder_types())
def test_encoder_zoo_parity(model_type, tmp_path, single_thread):
    path = _save_reference(model_type, tmp_path / model_type)
    _check_mlm_and_save(model_type, path, tmp_path / "saved")
    _check_activation_checkpointing(model_type, path)
    _check_heads(model_type)
    discriminator = None
    if model_type == "electra":
        torch.manual_seed(2)
        discriminator = str(tmp_path / "discriminator")
        _om_class(model_type, "pretraining").hf_twin(tiny_config(model_type)).save_pretrained(discriminator)
    one_group = None
    if model_type == "albert":  # 2 layers over 1 group: with 2 stages each rank runs it once
        torch.manual_seed(4)
        one_group = str(tmp_path / "one_group")
        _om_class(model_type).hf_twin(tiny_config(model_type, num_hidden_layers=2, num_hidden_groups=1)
                                      ).save_pretrained(one_group)
    run_distributed(_layouts_worker, 4, model_type, path, discriminator, _pipeline_heads(model_type, tmp_path),
                    one_group)


def test_albert_zero_pipeline_refused_before_any_process_group():
    """ZeRO-2/3 x pp where a pipeline rank runs a shared layer group at several depths: refused by the validation
    (``from_pretrained``'s and the composition check's), with the reason; ZeRO-1, and layouts where each rank runs
    each group once, pass."""
    from oslo_models.composition.axes import Layout
    from oslo_models.composition.check import refusal

    om_class, config = _om_class("albert"), tiny_config("albert")  # 4 layers over 2 groups
    for partition, rank, group in (("uniform", 0, 0), ((1, 3), 1, 1)):
        for stage in (2, 3):
            parallel = om.ParallelConfig(pipeline_parallel_size=2, zero_stage=stage, pipeline_partition=partition)
            with pytest.raises(ValueError, match=fr"pipeline rank {rank} runs the shared layer group\(s\) \[{group}\] "
                                                 r"at several depths.*use zero_stage=1"):
                om_class.validate_parallel_config(config, parallel)
    layout = Layout(parallel=dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2), zero_stage=3)
    assert "several depths" in refusal(layout, om_class, config)
    assert refusal(Layout(parallel=layout.parallel, zero_stage=1), om_class, config) is None
    one_group = tiny_config("albert", num_hidden_layers=2, num_hidden_groups=1)
    om_class.validate_parallel_config(one_group, om.ParallelConfig(pipeline_parallel_size=2, zero_stage=3))


def test_shared_albert_groups_are_one_parameter(single_thread):
    """ALBERT's depth sharing: 4 layers over 2 groups run each group twice with one parameter each (gradients summed
    by autograd, one key saved); the wrong grouping (one group per layer index modulo) does not match transformers
    (negative control of the index rule)."""
    config = tiny_config("albert")
    model = _om_class("albert", "base")(config, add_pooling_layer=False)
    layers = model._layers()
    assert [id(layer) for layer in layers] == [id(model.encoder.albert_layer_groups[g]) for g in (0, 0, 1, 1)]
    assert sum(1 for name, _ in model.named_parameters() if "albert_layer_groups" in name) == 2 * 2 * 16
    torch.manual_seed(0)
    reference = _om_class("albert").hf_twin(config).eval()
    mlm = _om_class("albert")(config).eval()
    mlm.load_from_reader(InMemoryReader(reference.state_dict()))
    batch = _batch(config, rows=2, seq=8)
    batch.pop("labels")
    with torch.no_grad():
        torch.testing.assert_close(mlm(**batch).logits, reference(**batch).logits, atol=1e-5, rtol=1e-4)
        groups = mlm.albert.encoder.albert_layer_groups
        mlm.albert._layers = lambda: [groups[i % 2] for i in range(4)]  # interleaved: the wrong rule
        with pytest.raises(AssertionError):  # fails the parity tolerance the zoo asserts
            torch.testing.assert_close(mlm(**batch).logits, reference(**batch).logits, atol=1e-5, rtol=1e-4)
