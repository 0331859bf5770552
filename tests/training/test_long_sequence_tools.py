"""The long-sequence memory tools (issue 52): the sequence-tiled MLP (``ParallelConfig.tiled_mlp``), activation
offload (``ParallelConfig.activation_offload``) and the tiled loss (the heads' ``skip_logits=True``) train exactly
as the plain run, and the tiling removes the ``[b, s, ffn]`` / ``[b, s, vocab]`` tensors from what a step keeps.

- In process: Llama, GPT-2 (dense MLP), Gemma 2 (sandwich norms), Phi and GPT-NeoX (parallel residual) with 3 tiles
  and with offload (every saved tensor moved): loss and every gradient equal the plain model (1e-6).
- Saved-for-backward bytes of one training forward (every tensor autograd keeps, parameters excluded): the tiled
  MLP keeps at least ``2 * layers * b * s * ffn * 4`` bytes less than the plain run, the tiled loss at least the
  ``[b, s, V]`` fp32 logits less. Negative controls: one tile saves nothing; ``tiled_mlp`` without the parameters
  as inputs of its node leaves the MLP weights without gradients; an offload whose unpack returns zeros changes
  the gradients.
- One world of 2 gloo processes: Llama at tp 2 + SP, at dp 2 ZeRO-3 and at pp 2 (1F1B, 2 microbatches,
  ``train_step``) with tiled MLP + offload: 3 AdamW steps
  equal single-process ``transformers`` on the global batch (losses, logits, gradients, parameters; 1e-5,
  ``train_matches``); with tiled MLP + offload + the tiled loss, 3 AdamW steps' losses and parameters equal the
  plain run of the same layout (1e-5). Breakage tried: the tiles' recompute outside the forward's sequence-
  parallel switch (the backward runs after the stack left it) fails tp 2 + SP at the first gradient.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.common.stack.long_sequence import apply_activation_offload, apply_tiled_mlp
from oslo_models.parallel_layers.tiled_mlp import tiled_mlp
from oslo_models.training.activation_offload import ActivationOffload
from tests.helpers.decoders import save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.pipeline import ADAMW, assert_pipeline_matches

HEADS = {"gpt2": "LMHeadModel"}
TYPES = ("llama", "gpt2", "gemma2", "phi", "gpt_neox")


def _model(path, **options):
    parallel = om.ParallelConfig(**options)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, progress=False).train()


def _batch(seq=16, rows=2, seed=1):
    ids, mask, labels = padded_batch(101, batch=rows, seq=seq, seed=seed)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


@pytest.mark.parametrize("model_type", TYPES)
def test_tiled_mlp_and_offload_equal_the_plain_run(tmp_path, model_type):
    path = save_tiny(tmp_path, model_type, HEADS.get(model_type, "ForCausalLM"))
    batch = _batch()
    plain = _model(path)
    expected = plain(**batch).loss
    expected.backward()
    for options in (dict(tiled_mlp=3), dict(activation_offload=0), dict(tiled_mlp=5, activation_offload=0)):
        model = _model(path, **options)
        loss = model(**batch).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
        assert assert_grads_match(model, plain, atol=1e-6, rtol=1e-5) == len(list(model.parameters()))
        if "activation_offload" in options:
            assert model.activation_offload.moved_bytes > 0


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the distinct storages autograd keeps in a forward, parameters excluded."""

    def __init__(self):
        self.storages = {}

        def pack(tensor):
            if not isinstance(tensor, torch.nn.Parameter) and tensor.layout == torch.strided:
                storage = tensor.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        super().__init__(pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _saved(model, batch, **call) -> int:
    saved = _SavedBytes()
    with saved:  # the forward: what the step keeps until its backward
        loss = model(**batch, **call).loss
    loss.backward()
    return saved.total


def test_tiling_removes_the_whole_ffn_and_vocab_tensors(tmp_path):
    path = save_tiny(tmp_path, "llama")
    model = _model(path)
    config = model.config
    batch = _batch(seq=64)
    b, s = batch["input_ids"].shape
    ffn_bytes = b * s * config.intermediate_size * 4
    plain = _saved(model, batch)
    apply_tiled_mlp(model, 4)
    tiled = _saved(model, batch)
    assert plain - tiled >= 2 * config.num_hidden_layers * ffn_bytes, (plain, tiled, ffn_bytes)
    apply_tiled_mlp(model, 1)  # negative control: one slice is the plain MLP
    assert _saved(model, batch) == plain
    apply_tiled_mlp(model, None)
    logits_bytes = b * s * config.vocab_size * 4
    tiled_loss = _saved(model, batch, skip_logits=True)
    assert plain - tiled_loss >= logits_bytes, (plain, tiled_loss, logits_bytes)


def test_tiled_mlp_needs_its_parameters_as_inputs():
    """Negative control of the gradient path: without the parameters as inputs of the tiled node, the weights get
    no gradient (the recompute's gradients would be lost)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    x = torch.randn(2, 12, 8, requires_grad=True)
    mlp(x).square().sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()] + [x.grad.clone()]
    mlp.zero_grad(), x.grad.zero_()
    tiled_mlp(mlp, x, tuple(mlp.parameters()), 5).square().sum().backward()
    for got, want in zip([p.grad for p in mlp.parameters()] + [x.grad], expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    mlp.zero_grad(), x.grad.zero_()
    tiled_mlp(mlp, x, (), 5).square().sum().backward()
    assert all(p.grad is None for p in mlp.parameters())
    torch.testing.assert_close(x.grad, expected[-1], rtol=1e-6, atol=1e-6)  # the input's gradient still flows


class _ZeroOffload(ActivationOffload):
    def _unpack(self, packed):
        return torch.zeros_like(super()._unpack(packed))


def test_offload_negative_control_and_refusals(tmp_path):
    path = save_tiny(tmp_path, "llama")
    batch = _batch()
    plain = _model(path)
    plain(**batch).loss.backward()
    broken = _model(path)
    hooks = _ZeroOffload(0)
    for block in broken.model.layers:
        block.register_forward_pre_hook(lambda *a: hooks.__enter__())
        block.register_forward_hook(lambda *a: hooks.__exit__(None, None, None))
    broken(**batch).loss.backward()
    with pytest.raises(AssertionError):
        assert_grads_match(broken, plain, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="activation_checkpointing='offload'"):
        om.ParallelConfig(activation_offload=True, activation_checkpointing="full")
    with pytest.raises(ValueError, match="tiled_mlp must be"):
        om.ParallelConfig(tiled_mlp=0)
    with pytest.raises(ValueError, match="activation_offload must be"):
        om.ParallelConfig(activation_offload="yes")
    model = _model(path)
    model.set_activation_checkpointing("full")
    with pytest.raises(ValueError, match="activation_checkpointing='offload'"):
        apply_activation_offload(model, True)


def test_tiled_mlp_refusals(tmp_path):
    path = save_tiny(tmp_path / "mixtral", "mixtral")
    with pytest.raises(NotImplementedError, match="mixture of experts"):
        _model(path, tiled_mlp=2)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=101)
    ).save_pretrained(tmp_path / "bert")
    with pytest.raises(NotImplementedError, match="only causal decoders"):
        om.AutoModelForMaskedLM.from_pretrained(tmp_path / "bert", parallel=om.ParallelConfig(tiled_mlp=2),
                                                progress=False)
    granite = transformers.GraniteConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=101)
    for options in (dict(tiled_mlp=2), dict(activation_offload=True), dict(tiled_loss=True)):  # the generic path:
        with pytest.raises(ValueError, match="generic path.*long-sequence tools"):  # refused before loading
            om.AutoModelForCausalLM.from_config(granite, parallel=om.ParallelConfig(**options))
    gpt2 = save_tiny(tmp_path / "gpt2", "gpt2", "LMHeadModel", resid_pdrop=0.1)
    with pytest.raises(ValueError, match="dropout"):
        _model(gpt2, tiled_mlp=2)(**_batch())


def _steps(model, batch: dict, zero_stage: int, steps: int = 3, **call):
    """Losses of ``steps`` AdamW steps and the parameters after them (the layout's local tensors)."""
    from accelerate import Accelerator
    from oslo_models import training

    ctx = model.parallel_context
    local = {k: v[ctx.dp_rank::ctx.dp_size] for k, v in batch.items()}
    count = int((batch["labels"][:, 1:] != -100).sum())
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    if zero_stage:
        model, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=zero_stage)
    else:
        model, optimizer = training.shard_data_parallel(model, optimizer)
    losses = []
    for _ in range(steps):
        loss = model(**local, num_items_in_batch=count / ctx.dp_size, **call).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.detach())
    inner = training.unwrap_model(model)
    params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
              for p in inner.parameters()]
    return losses, params


def _worker(path):
    batch = _batch(seq=16, rows=4, seed=3)
    reference_class = transformers.LlamaForCausalLM
    for name, layout, zero_stage in (("tp2+sp", dict(tensor_parallel_size=2, sequence_parallel=True), 0),
                                     ("dp2 zero3", dict(data_parallel_size=2), 3)):
        breadcrumb(f"{name}: tiled MLP + offload against transformers")
        model = _model(path, **layout, tiled_mlp=3, activation_offload=0)
        train_matches(model, reference_class.from_pretrained(path).train(), batch, zero_stage=zero_stage, steps=3)
        breadcrumb(f"{name}: + tiled loss against the plain run")
        plain_losses, plain_params = _steps(_model(path, **layout), batch, zero_stage)
        losses, params = _steps(_model(path, **layout, tiled_mlp=3, activation_offload=0), batch, zero_stage,
                                skip_logits=True)
        for got, want in zip(losses, plain_losses):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for got, want in zip(params, plain_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    breadcrumb("pp2: tiled MLP + offload through the pipeline schedule against transformers")
    model = _model(path, pipeline_parallel_size=2, num_microbatches=2, tiled_mlp=3, activation_offload=0)
    assert_pipeline_matches(model, reference_class.from_pretrained(path).train(), batch)
    assert model.activation_offload.moved_bytes > 0  # the stage's blocks ran through the hooks


@pytest.mark.slow
def test_long_sequence_tools_tp2_sp_and_zero3(tmp_path):
    path = save_tiny(tmp_path, "llama")
    run_distributed(_worker, 2, path, timeout=1200)
