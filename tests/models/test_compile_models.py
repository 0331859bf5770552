"""``torch.compile`` of whole models at tp 1 and tp 2: ``fullgraph=True`` (so no graph break anywhere, blocks,
tensor-parallel collectives and the fused loss-only head included), and compiled equals eager in the loss and
every gradient. ``aot_eager`` traces forward and backward like inductor does without needing a C compiler on
the CI box. Dropout is off in these tiny models: at tp > 1 a dropout that draws from the tensor-parallel RNG
stream swaps generator states, which ``torch.compile`` cannot trace (see docs/fused-ops.md, "torch.compile")."""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch, save_tiny_gpt2


def _causal_batch():
    ids, mask, labels = padded_batch(101)
    return dict(input_ids=ids, attention_mask=mask), labels


# name -> (Auto class, batch); skip_logits per layout below exercises both heads
AUTO = {"gpt2": ("AutoModelForCausalLM", _causal_batch), "llama": ("AutoModelForCausalLM", _causal_batch)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    # one layer each: compile time grows with the layers, and one block shows what every block does
    return {"gpt2": save_tiny_gpt2(root / "gpt2", n_layer=1),
            "llama": decoders.save_tiny(root / "llama", "llama", num_hidden_layers=1)}


def assert_compiled_equals_eager(path: str, name: str, *, skip_logits: bool, **parallel) -> None:
    auto, batch = AUTO[name]
    model = getattr(om, auto).from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False).train()
    inputs, labels = batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # a graph break raises
    results = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        out = fn(**inputs, labels=labels, skip_logits=skip_logits)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, grads), (loss_c, grads_c) = results
    where = f"{name} {parallel} skip_logits={skip_logits}"
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5, msg=lambda m: f"{where} loss: {m}")
    for n, grad in grads.items():
        torch.testing.assert_close(grads_c[n], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{where} {n}: {m}")


# Compiling is slow on the 2-core CI box: two families here; benchmarks/compile_graph_breaks.py counts the graph
# breaks of GPT-2, BERT, T5 and Llama at tp 1 and 2 (zero each, docs/fused-ops.md "torch.compile").
@pytest.mark.parametrize("name,skip_logits", [("gpt2", True), ("llama", False)])
def test_compiled_equals_eager_tp1(checkpoints, name, skip_logits):
    assert_compiled_equals_eager(checkpoints[name], name, skip_logits=skip_logits)


def _tp2_worker(paths: dict) -> None:
    assert_compiled_equals_eager(paths["gpt2"], "gpt2", skip_logits=True, tensor_parallel_size=2,
                                 sequence_parallel=True)


def test_compiled_equals_eager_tp2(checkpoints):
    run_distributed(_tp2_worker, 2, {"gpt2": checkpoints["gpt2"]}, timeout=300)  # compiling is slow


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_moe_block_compiles_whole(model_type):
    """The sparse block of each MoE decoder (router, ep-1 dispatch with static shapes, the dropless grouped experts as
    one ``oslo_models::grouped_mm`` custom op per projection, combine; shared experts) traces as one graph
    (``fullgraph=True``, ``aot_eager``), and compiled forward and every gradient equal eager."""
    from tests.helpers.zoo import tiny_config

    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(tiny_config(model_type)).train()
    block = next(layer.mlp for layer in model.model.layers if layer.is_sparse)
    x = torch.randn(2, 7, model.config.hidden_size, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)  # a graph break raises
    results = []
    for fn in (block, compiled):
        block.zero_grad(set_to_none=True)
        out = fn(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *block.parameters()], allow_unused=True)
        results.append((out.detach(), grads))
    (out, grads), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)
    for got, ref in zip(grads_c, grads, strict=True):
        if ref is not None:
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
