"""``torch.compile`` of whole models at tp 1 and tp 2: ``fullgraph=True`` (so no graph break anywhere, blocks,
tensor-parallel collectives and the fused loss-only head included), and compiled equals eager in the loss and
every gradient. ``aot_eager`` traces forward and backward like inductor does without needing a C compiler on
the CI box. Dropout is off in these tiny models: at tp > 1 a dropout that draws from the tensor-parallel RNG
stream swaps generator states, which ``torch.compile`` cannot trace (see docs/fused-ops.md, "torch.compile")."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.fused_ops._utils import interpreter_enabled
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import mlm_batch, save_tiny, seq2seq_batch, tiny_bert_config, tiny_t5_config
from tests.helpers.models import padded_batch, save_tiny_gpt2


def _causal_batch():
    ids, mask, labels = padded_batch(101)
    return dict(input_ids=ids, attention_mask=mask), labels


# name -> (Auto class, batch); skip_logits per layout below exercises both heads
AUTO = {"gpt2": ("AutoModelForCausalLM", _causal_batch), "llama": ("AutoModelForCausalLM", _causal_batch),
        "bert": ("AutoModelForMaskedLM", mlm_batch), "t5": ("AutoModelForSeq2SeqLM", seq2seq_batch)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    # one layer each: compile time grows with the layers, and one block shows what every block does
    return {"gpt2": save_tiny_gpt2(root / "gpt2", n_layer=1),
            "llama": decoders.save_tiny(root / "llama", "llama", num_hidden_layers=1),
            "bert": save_tiny(root / "bert", transformers.BertForMaskedLM, tiny_bert_config(num_hidden_layers=1)),
            "t5": save_tiny(root / "t5", transformers.T5ForConditionalGeneration,
                            tiny_t5_config("gated-gelu", num_layers=1, num_decoder_layers=1))}


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


# Compiling is slow on the 2-core CI box: four families here; benchmarks/compile_graph_breaks.py counts the graph
# breaks of every native family (BENCHMARKS.md, "torch.compile graph breaks of every native family").
# one of each kind: decoder (GPT-2, Llama), encoder (BERT masked LM), encoder-decoder (T5 v1.1); the MoE blocks below
@pytest.mark.parametrize("name,skip_logits", [("gpt2", True), ("llama", False), ("bert", True), ("t5", False)])
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
    # without output_router_logits: the model then has no transformers recording hook on the router, whose
    # ContextVar lookup dynamo cannot trace outside a compiled base model (whole models trace it:
    # common/stack/outputs.py)
    model = om.AutoModelForCausalLM.from_config(tiny_config(model_type, output_router_logits=False)).train()
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


@pytest.mark.skipif(not interpreter_enabled(), reason="runs the Triton kernels on CPU: needs TRITON_INTERPRET=1")
def test_fused_kernels_inside_the_compiled_graph(checkpoints, monkeypatch):
    """With the Triton kernels forced (``OSLO_FUSED_OPS=force``; the dispatcher's default under compile is the
    references, BENCHMARKS.md) a BERT masked-LM training step (the loss-only head) compiles as one graph with the
    kernels in it: layer norm, bias-GELU and the chunked cross-entropy's statistics in the forward graph, their
    backward ops in the backward graph (custom ops with fakes and autograd), and the compiled loss and every gradient
    equal eager."""
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setenv("OSLO_FUSED_OPS", "force")
    graphs = {"forward": [], "backward": []}

    def recorder(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind].extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm.forward
        return compile_graph

    model = om.AutoModelForMaskedLM.from_pretrained(checkpoints["bert"], progress=False).train()
    inputs, labels = mlm_batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=recorder("forward"),
                                                         bw_compiler=recorder("backward")), fullgraph=True)
    results = []
    for fn in (model, compiled):
        model.zero_grad(set_to_none=True)
        out = fn(**inputs, labels=labels, skip_logits=True)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    fused = {kind: sorted({op for op in ops if op.startswith("oslo_models.")}) for kind, ops in graphs.items()}
    assert {"oslo_models.layer_norm.default", "oslo_models.bias_gelu.default"} <= set(fused["forward"]), fused
    assert {"oslo_models.layer_norm_backward.default", "oslo_models.bias_gelu_backward.default"} <= set(
        fused["backward"]), fused
    assert any("cross_entropy" in op for op in fused["forward"]), fused
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
    for n, grad in grads.items():
        torch.testing.assert_close(grads_c[n], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_recording_hooks_installed_at_construction():
    """A config that records on every call (``output_router_logits=True``) gets ``transformers``' recording hooks
    when the model is built, not inside a compiled first forward (where installing them takes a thread lock dynamo
    cannot trace); each router logit is still recorded once. Without recording, no hooks."""
    from tests.helpers.zoo import tiny_config

    output_capturing = pytest.importorskip("transformers.utils.output_capturing")
    if not hasattr(output_capturing, "maybe_install_capturing_hooks"):
        pytest.skip("this transformers installs its recording hooks on first use only")
    model = om.AutoModelForCausalLM.from_config(tiny_config("mixtral"))
    assert getattr(model.model, "_output_capturing_hooks_installed", False)
    assert not getattr(model, "_output_capturing_hooks_installed", False)  # the base model's only, as transformers
    ids, mask, _ = padded_batch(model.config.vocab_size)
    out = model(input_ids=ids, attention_mask=mask)
    assert len(out.router_logits) == model.config.num_hidden_layers
    plain = om.AutoModelForCausalLM.from_config(tiny_config("mixtral", output_router_logits=False))
    assert not getattr(plain.model, "_output_capturing_hooks_installed", False)
