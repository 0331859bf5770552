"""Single-process checks of the 2D / 2.5D / 3D tensor-parallel modes: config validation (errors before any process
group exists), the 2-dim ``GridBlock`` layouts, and a q=1 grid model equal to ``transformers``."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.parallel_layers.sharding import EvenSplit, GridBlock, PackedSplit, VocabSplit
from tests.helpers import decoders
from tests.helpers.models import padded_batch, save_tiny_gpt2

GRID_DEPTH = "q\\*q\\*tensor_parallel_depth"


@pytest.mark.parametrize("options,match", [
    (dict(tensor_parallel_size=2, tensor_parallel_mode="2d"), "a square"),
    (dict(tensor_parallel_size=8, tensor_parallel_mode="2d"), "a square"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="2.5d", tensor_parallel_depth=2), GRID_DEPTH),
    (dict(tensor_parallel_size=8, tensor_parallel_mode="2.5d", tensor_parallel_depth=3), GRID_DEPTH),
    (dict(tensor_parallel_size=2, tensor_parallel_depth=2), "only used by tensor_parallel_mode='2.5d'"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="2d", sequence_parallel=True), "sequence_parallel"),
    (dict(tensor_parallel_size=4, tensor_parallel_mode="3d"), "a cube"),
])
def test_grid_sizes_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        om.ParallelConfig(**options)


def test_pipeline_parallelism_composes():
    # tests/parallel_layers/test_tp_modes_pipeline.py runs it; expert parallelism is refused (tests/test_config.py)
    assert om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d",
                             pipeline_parallel_size=2).model_parallel_size == 8


def test_grid_shape():
    assert om.ParallelConfig(tensor_parallel_size=4).grid_shape == (4,)
    assert om.ParallelConfig(tensor_parallel_size=9, tensor_parallel_mode="2d").grid_shape == (3, 3)
    assert om.ParallelConfig(tensor_parallel_size=8, tensor_parallel_mode="2.5d",
                             tensor_parallel_depth=2).grid_shape == (2, 2, 2)
    assert om.ParallelConfig(tensor_parallel_size=27, tensor_parallel_mode="3d").grid_shape == (3, 3, 3)


def _context(i: int, j: int, q: int = 2):
    axes = {"tp_col": SimpleNamespace(rank=i, size=q), "tp_row": SimpleNamespace(rank=j, size=q)}
    return SimpleNamespace(axis=lambda name: axes[name], tp_size=q * q)


def test_two_dim_blocks_read_only_their_block():
    full = torch.arange(5 * 12.0).view(5, 12)  # 5 vocabulary rows (padded to 6), 12 = 3 packed blocks of 4
    reads = []

    def read(index):
        reads.append(index)
        return full[index]

    vocab = GridBlock(VocabSplit(0, 5, "tp_col"), EvenSplit(1, "tp_row"))
    packed = GridBlock(PackedSplit(1, (1, 1, 1), axis="tp_row"), EvenSplit(0, "tp_col"))
    for i in range(2):
        for j in range(2):
            ctx = _context(i, j)
            rows = full[3 * i: 3 * i + 3, 6 * j: 6 * j + 6]
            if i == 1:  # the padding row of the vocabulary
                rows = torch.cat([rows, torch.zeros(1, 6)])
            assert vocab.local_shape_in((5, 12), ctx) == (3, 6)
            torch.testing.assert_close(vocab.read_local((5, 12), read, ctx), rows, rtol=0, atol=0)
            assert vocab.full_shape_of((3, 6), ctx) == (5, 12)
            packed_full = full[:4]
            block = torch.cat([packed_full[2 * i: 2 * i + 2, 4 * p + 2 * j: 4 * p + 2 * j + 2] for p in range(3)], 1)
            torch.testing.assert_close(packed.read_local((4, 12), lambda index: packed_full[index], ctx), block,
                                       rtol=0, atol=0)
            # Negative control: the transposed grid position reads another block.
            if i != j:
                assert not torch.equal(vocab.read_local((5, 12), read, _context(j, i)), rows)
    assert all(isinstance(index, tuple) for index in reads)
    # No read ever asks for more than one block's rows and columns.
    assert all((index[0].stop or 5) - (index[0].start or 0) <= 3 for index in reads)


def _assert_one_step_matches(model, reference) -> None:
    """Logits and every gradient of one padded batch equal the reference's (q=1: nothing is split)."""
    ids, mask, labels = padded_batch(101, batch=2, seq=8)
    expected, got = reference(ids, attention_mask=mask, labels=labels), model(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
    expected.loss.backward()
    got.loss.backward()
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref[name].grad, atol=1e-5, rtol=1e-4)


def test_q1_grid_model_matches_transformers(tmp_path):
    path = save_tiny_gpt2(tmp_path / "gpt2")
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    model = om.AutoModelForCausalLM.from_pretrained(
        path, parallel=om.ParallelConfig(tensor_parallel_mode="2d"), progress=False).train()
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "Linear2D"
    _assert_one_step_matches(model, reference)


def test_unplanned_module_is_refused_under_a_grid_mode(tmp_path):
    path = save_tiny_gpt2(tmp_path / "cls", cls=transformers.GPT2ForSequenceClassification)
    with pytest.raises(NotImplementedError, match="score"):
        om.AutoModelForSequenceClassification.from_pretrained(
            path, parallel=om.ParallelConfig(tensor_parallel_mode="2d"), progress=False)


def test_llama_heads_must_split_over_the_grid():
    """Key/value heads follow the grid's q hidden blocks: fewer than q is a ValueError before any process group
    (1D replicates them instead)."""
    config = decoders.tiny_config("llama", num_key_value_heads=1)
    om.LlamaForCausalLM.validate_parallel_config(config, om.ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="num_key_value_heads=1 is not divisible by 2"):
        om.LlamaForCausalLM.validate_parallel_config(
            config, om.ParallelConfig(tensor_parallel_size=8, tensor_parallel_mode="3d"))
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by 3"):
        om.LlamaForCausalLM.validate_parallel_config(
            decoders.tiny_config("llama"), om.ParallelConfig(tensor_parallel_size=9, tensor_parallel_mode="2d"))


def test_q1_grid_llama_matches_and_experts_are_refused(tmp_path):
    """A q=1 grid Llama (RMSNorm2D with Llama's rounding, KV heads as a grid linear) equals ``transformers``;
    mixture-of-experts layers have no grid layout and say so while the model is built."""
    path = decoders.save_tiny(tmp_path / "llama", "llama")
    grid = om.ParallelConfig(tensor_parallel_mode="3d")
    reference = decoders.hf_class("llama").from_pretrained(path).train()
    model = om.LlamaForCausalLM.from_pretrained(path, parallel=grid, progress=False).train()
    assert type(model.model.layers[0].self_attn.k_proj).__name__ == "Linear3D"
    _assert_one_step_matches(model, reference)
    mixtral = transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2, vocab_size=decoders.VOCAB)
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        om.MixtralForCausalLM.from_config(mixtral, parallel=grid)
