"""T5ForConditionalGeneration pipelined (encoder blocks then decoder blocks, cut anywhere) equals single-process
``transformers`` for the tied ReLU T5 and the untied gated-GELU T5 v1.1: padded encoder inputs and padded labels
(-100) of another length; every pp=2 schedule, pp=4, pp x tp with sequence parallelism, pp x dp — loss, every
gradient and the parameters after 3 AdamW steps; each stage holds only its own parameters; a save from
pp=2 x tp=2 opens in plain ``transformers`` with the same logits.

3 encoder + 3 decoder layers, so stages end inside the encoder, at its end, inside the decoder, and one stage can
hold both the encoder's end and the decoder's start. Two spawned worlds (2 CPU cores); each worker runs several
layouts one after the other.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.pipeline import adapter_for
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import VOCAB, tiny_t5_config
from tests.helpers.models import padded_batch
from tests.helpers.pipeline import assert_pipeline_matches

NUM_LAYERS = 3  # per stack: flat layers 0-2 are encoder blocks, 3-5 decoder blocks


def _save_t5(path, *, gated: bool) -> str:
    """Original T5 (ReLU, head tied to ``shared`` and rescaled) or T5 v1.1 (gated-GELU, a head of its own, which
    ``transformers`` keeps untied because the checkpoint's differs from ``shared``)."""
    torch.manual_seed(1)
    config = tiny_t5_config("gated-gelu" if gated else "relu", num_layers=NUM_LAYERS, tie_word_embeddings=not gated)
    model = transformers.T5ForConditionalGeneration(config)
    if gated:
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * config.d_model ** -0.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5")
    return _save_t5(root / "relu", gated=False), _save_t5(root / "gated", gated=True)


def _batch() -> dict[str, torch.Tensor]:
    """4 encoder rows of 8 (8, 6, 4, 2 tokens) and decoder labels of 4 (4, 3, 2, 4 tokens, -100 on padding)."""
    ids, mask, _ = padded_batch(VOCAB, batch=4, seq=8)
    decoder_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    labels = torch.randint(2, VOCAB, (4, 4), generator=torch.Generator().manual_seed(2))
    labels = labels.masked_fill(decoder_mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, decoder_attention_mask=decoder_mask, labels=labels)


def _assert_resident(model, reference) -> None:
    """The rank's parameters are exactly its blocks', plus ``shared`` on the first stage, the encoder's final norm
    on the stage ending the encoder, and the decoder's final norm and ``lm_head`` (a copy when tied) on the last."""
    layout, layer_ids = model.pipeline_layout, adapter_for(model).layer_ids(model)
    prefixes = tuple(f"{layer_ids[i][0]}.{layer_ids[i][1]}." for i in layout.local_layers())
    names = {"shared.weight"} if layout.has_first else set()
    if NUM_LAYERS - 1 in layout.local_layers():
        names.add("encoder.final_layer_norm.weight")
    if layout.has_last:
        names |= {"decoder.final_layer_norm.weight", "lm_head.weight"}
    expected = {name for name, _ in reference.named_parameters() if name.startswith(prefixes)} | names
    assert {name for name, _ in model.named_parameters()} == expected


def _run_layout(path: str, cfg: om.ParallelConfig, batch, *, save_to=None, max_grad_norm=None):
    reference = transformers.T5ForConditionalGeneration.from_pretrained(path).train()
    model = om.AutoModelForSeq2SeqLM.from_pretrained(path, parallel=cfg, progress=False).train()
    assert model.parallel_context.pp_size == cfg.pipeline_parallel_size
    _assert_resident(model, reference)
    assert_pipeline_matches(model, reference, batch, max_grad_norm=max_grad_norm)
    if save_to is not None:
        model.save_pretrained(save_to)
        if model.parallel_context.rank == 0:
            inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
            inputs["decoder_input_ids"] = reference._shift_right(batch["labels"])
            loaded = transformers.T5ForConditionalGeneration.from_pretrained(save_to).eval()
            reference.eval()
            torch.testing.assert_close(loaded(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=1e-5)
            tied = reference.config.scale_decoder_outputs
            assert ("lm_head.weight" in _saved_keys(save_to)) is not tied  # a tied head is saved as shared only
        model.parallel_context.barrier()
    return model, reference


def _saved_keys(folder: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as file:
        return set(file.keys())


def _world2_worker(relu: str, gated: str) -> None:
    batch = _batch()
    layouts = [  # (schedule, virtual stages, microbatches, layers per stage)
        ("gpipe", 1, 2, "uniform"),  # 3 | 3: the encoder output crosses alone
        ("1f1b", 1, 4, (2, 4)),  # stage 1 ends the encoder and starts the decoder
        ("interleaved_1f1b", 2, 4, (2, 2, 1, 1)),  # stage 2: decoder block 1 between decoder stages
        ("zero_bubble", 2, 4, (1, 1, 2, 2)),  # stage 1 passes the encoder bias on, stage 2 decoder block 0's
        ("zero_bubble", 1, 2, (4, 2)),
    ]
    for path in (relu, gated):
        for schedule, virtual, microbatches, partition in layouts:
            cfg = om.ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=microbatches,
                                    virtual_pipeline_size=virtual, pipeline_partition=partition)
            _run_layout(path, cfg, batch)


def _world4_worker(relu: str, gated: str, save_to: str) -> None:
    batch = _batch()
    # pp=4: (1, 2, 2, 1) hands the encoder output over alone, decoder block 0's stage sends its bias on; the
    # partition by parameter counts gives (2, 2, 1, 1).
    for path, partition in ((relu, (1, 2, 2, 1)), (gated, "parameters")):
        cfg = om.ParallelConfig(pipeline_parallel_size=4, num_microbatches=4, pipeline_partition=partition)
        _run_layout(path, cfg, batch, max_grad_norm=1.0 if path == relu else None)
    for path in (relu, gated):
        cfg = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                                num_microbatches=2, pipeline_partition=(2, 4))
        model, reference = _run_layout(path, cfg, batch, save_to=os.path.join(save_to, os.path.basename(path)))
        # Each stack runs sequence-parallel only when its own length splits, as unpipelined.
        for enc_len, dec_len in ((8, 3), (7, 4)):
            odd = {name: tensor[:, :enc_len if name in ("input_ids", "attention_mask") else dec_len].contiguous()
                   for name, tensor in batch.items()}
            with torch.no_grad():
                torch.testing.assert_close(model.eval_step(odd), reference(**odd).loss, atol=1e-5, rtol=1e-5)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    _run_layout(gated, cfg, _batch())  # pp x dp: unequal label counts, the global batch's loss


def test_pp2_every_schedule_matches_transformers(checkpoints):
    run_distributed(_world2_worker, 2, *checkpoints)


def test_pp4_and_pp_tp_and_pp_dp_match_transformers(checkpoints, tmp_path):
    run_distributed(_world4_worker, 4, *checkpoints, str(tmp_path))
