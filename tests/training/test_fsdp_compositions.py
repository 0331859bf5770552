"""Data parallelism (ZeRO 1-3) composed with the other axes, on one spawned world of 4 ranks, against
single-process ``transformers`` (fp32, 1e-5: the loss of every step, every gradient, the clipped global norm, the
parameters after 3 AdamW steps):

- pp2 x dp2 GPT-2 at ZeRO-1 through ``om.training.prepare``: the optimizer state of each stage sharded over dp;

tiny Llama (untied, biases):

- pp2 x dp2 at ZeRO-2 (+ CPU offload, 1f1b) and ZeRO-3 (zero-bubble, 2 stages per rank): each pipeline stage an
  FSDP2 root over dp; gradients are reduce-scattered once per step, not once per microbatch (counted);
- cp2 x dp2 at ZeRO-3: sharded over dp x cp;
- HSDP: dp4 with ``data_parallel_shard_size=2`` at ZeRO-3 (shards over pairs, replicated across them).

Then a training checkpoint resharded across pipeline layouts on tied GPT-2, the reference stepping alongside:
pp2 x dp2 ZeRO-3 (step 1, save) -> pp1 HSDP dp4/2 (load, step 2, save) -> pp2 x tp2 (load, step 3, clipped:
tp-split shards added over tp, stages over pp, the tied embedding once); the tied ``wte``/``lm_head`` and the AdamW
moments cross every layout.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.optim import ZeroRedundancyOptimizer

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from tests.helpers.decoders import VOCAB, hf_class, save_tiny
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_params_match, padded_batch, save_tiny_gpt2
from tests.helpers.pipeline import ADAMW, assert_pipeline_matches, local_rows


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    return {"llama": save_tiny(root / "llama", "llama", num_hidden_layers=4),
            "gpt2": save_tiny_gpt2(root / "gpt2", n_layer=4)}


def _dense_batch(vocab: int = VOCAB) -> dict:
    ids = torch.randint(1, vocab, (8, 8), generator=torch.Generator().manual_seed(5))
    return {"input_ids": ids, "labels": ids}


class _CountReduceScatters:
    """Counts FSDP2's gradient reduce-scatters (``dist.reduce_scatter_single``) while active."""

    def __enter__(self):
        self.count, self.original = 0, dist.reduce_scatter_single

        def counting(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        dist.reduce_scatter_single = counting
        return self

    def __exit__(self, *exc):
        dist.reduce_scatter_single = self.original


def _fsdp_units(model) -> int:
    """FSDP2 parameter groups on this rank: each stage's layers, and its root when it holds parameters."""
    units = 0
    for module in training.training_state(model).stage_modules.values():
        in_layers = {id(p) for layer in module.layers for p in layer.parameters()}
        units += len(module.layers) + any(id(p) not in in_layers for p in module.parameters())
    return units


def _pipeline_fsdp(path: str) -> None:
    # ZeRO-2 + offload under 1f1b; ZeRO-3 under zero-bubble with 2 stages per rank (its backward run whole)
    for stage, offload, schedule in ((2, True, dict(pipeline_schedule="1f1b")),
                                     (3, False, dict(pipeline_schedule="zero_bubble", virtual_pipeline_size=2))):
        cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, zero_stage=stage,
                                **schedule)
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
        model, optimizer = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW),
                                                        cpu_offload=offload)
        assert all(hasattr(p, "to_local") for p in model.parameters())  # every parameter sharded over dp
        reference = hf_class("llama").from_pretrained(path).train()
        assert_pipeline_matches(model, reference, _dense_batch(), optimizer=optimizer, max_grad_norm=0.5)
        # one reduce-scatter per FSDP unit per step, not one per microbatch
        with _CountReduceScatters() as counter:
            model.train_step(local_rows(model.parallel_context, _dense_batch()))
        assert counter.count == _fsdp_units(model) == 3, (counter.count, _fsdp_units(model))
        optimizer.zero_grad()


def _llama_batch() -> dict:
    ids, mask, labels = padded_batch(VOCAB, batch=4, seq=16)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _data_context_fsdp(path: str) -> None:
    for options in (dict(context_parallel_size=2, data_parallel_size=2),
                    dict(data_parallel_size=4, data_parallel_shard_size=2)):
        cfg = om.ParallelConfig(zero_stage=3, **options)
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
        if "data_parallel_shard_size" in options:  # HSDP is FSDP2's: never silently dropped for ZeRO-1
            with pytest.raises(ValueError, match="HSDP .* needs zero_stage 2 or 3, got zero_stage=1"):
                training.shard_data_parallel(model, zero_stage=1)
        model, _ = train_matches(model, hf_class("llama").from_pretrained(path).train(), _llama_batch(),
                                 zero_stage=3, steps=3, max_grad_norm=0.5)
        weight = model.model.layers[0].mlp.up_proj.weight
        if "data_parallel_shard_size" in options:  # HSDP: replicated over 2 groups, sharded within a pair
            assert weight.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
            assert weight.to_local().shape[0] == weight.shape[0] // 2
        else:  # sharded over dp x cp = 4
            assert weight.to_local().shape[0] == weight.shape[0] // 4


def _data_parallel_step(model, reference, ref_opt, opt, batch) -> None:
    """One AdamW step of an unpipelined data-parallel model (each dp rank its rows) and of the reference."""
    expected = reference(**batch).loss
    expected.backward()
    ref_opt.step(), ref_opt.zero_grad()
    ctx = model.parallel_context
    loss = model(**{k: v.chunk(ctx.dp_size)[ctx.dp_rank] for k, v in batch.items()}).loss
    loss.backward()
    opt.step(), opt.zero_grad()
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=ctx.dp_group)
    torch.testing.assert_close(loss / ctx.dp_size, expected.detach(), atol=1e-5, rtol=1e-5)
    assert_params_match(training.unwrap_model(model), reference)


def _build(path: str, **options):
    cfg = om.ParallelConfig(**options)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    return training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW))


def _resharding_chain(path: str, folder: str) -> None:
    batch = _dense_batch(101)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    # pp2 x dp2, ZeRO-3 (an FSDP2 root per stage): the tied lm_head copy on stage 1 is not written
    model, opt = _build(path, pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, zero_stage=3)
    assert_pipeline_matches(model, reference, batch, steps=1, optimizer=opt, reference_optimizer=ref_opt)
    training.save_checkpoint(folder, model, opt, step=1)
    training.save_pretrained(model, folder + "-hub")  # gathered over dp, then over the stages: one Hub folder
    if dist.get_rank() == 0:
        saved = transformers.GPT2LMHeadModel.from_pretrained(folder + "-hub").state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(saved[name], value, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    # pp1, HSDP dp4 in pairs: reads the pp2 checkpoint (its AdamW moments included), saves its own
    model, opt = _build(path, data_parallel_size=4, data_parallel_shard_size=2, zero_stage=3)
    info = training.load_checkpoint(folder, model, opt)
    assert info["step"] == 1 and info["layout"]["pp"] == 2 and not info["same_layout"]
    assert_params_match(model, reference)
    _data_parallel_step(model, reference, ref_opt, opt, batch)
    training.save_checkpoint(folder, model, opt, step=2)
    # pp2 x tp2: the last stage's lm_head copy is read from the stored transformer.wte.weight; the clipped norm
    # adds tp-split shards over tp and stages over pp, the tied wte/lm_head once
    model, opt = _build(path, pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2)
    assert training.load_checkpoint(folder, model, opt)["step"] == 2
    assert_params_match(model, reference)
    assert_pipeline_matches(model, reference, batch, steps=1, optimizer=opt, reference_optimizer=ref_opt,
                            max_grad_norm=0.5)


def _pipeline_zero1(path: str) -> None:
    """pp2 x dp2 GPT-2 with ZeRO-1 through ``om.training.prepare`` (Accelerate's path): no DDP wrapper (the runner
    synchronizes gradients), the optimizer state of each stage sharded over dp exactly once."""
    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    prepared, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=1)
    assert prepared is model
    zero = training.zero.unwrap_optimizer(optimizer)
    assert isinstance(zero, ZeroRedundancyOptimizer)
    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    assert_pipeline_matches(model, reference, _dense_batch(101), optimizer=optimizer, max_grad_norm=0.5)
    owned = sum(p.numel() for group in zero.optim.param_groups for p in group["params"])
    stage_total = sum(p.numel() for p in model.parameters())
    assert 0 < owned < stage_total
    counts = torch.tensor([owned])
    dist.all_reduce(counts, group=model.parallel_context.dp_group)
    assert int(counts) == stage_total
    with pytest.raises(ValueError, match="num_microbatches"):
        training.prepare(Accelerator(cpu=True, gradient_accumulation_steps=2), model)


def _worker(paths: dict, folder: str) -> None:
    _pipeline_zero1(paths["gpt2"])
    _pipeline_fsdp(paths["llama"])
    _data_context_fsdp(paths["llama"])
    _resharding_chain(paths["gpt2"], folder)


def test_fsdp_with_pipeline_context_hsdp_and_resharded_checkpoints(checkpoints, tmp_path):
    run_distributed(_worker, 4, checkpoints, str(tmp_path / "ckpt"), timeout=600)


def test_hybrid_sharding_is_validated_before_any_process_group():
    cfg = om.ParallelConfig(zero_stage=3, data_parallel_shard_size=2, tensor_parallel_size=2)
    assert cfg.resolve_data_parallel_size(8) == 4
    with pytest.raises(ValueError, match="data_parallel_shard_size=2 must divide data_parallel_size=3"):
        cfg.resolve_data_parallel_size(6)
    with pytest.raises(ValueError, match="must divide data_parallel_size=6"):
        om.ParallelConfig(zero_stage=3, data_parallel_shard_size=4, data_parallel_size=6)
    with pytest.raises(ValueError, match="needs zero_stage 2 or 3"):
        om.ParallelConfig(zero_stage=1, data_parallel_shard_size=2)
    with pytest.raises(ValueError, match="positive int"):
        om.ParallelConfig(zero_stage=3, data_parallel_shard_size=0)
    for axis in ("context_parallel_size", "expert_parallel_size"):
        with pytest.raises(NotImplementedError, match=f"data_parallel_shard_size with {axis}"):
            om.ParallelConfig(zero_stage=3, data_parallel_shard_size=2, **{axis: 2})
    # composes now: ZeRO-2/3 with pipeline and with context parallelism
    om.ParallelConfig(zero_stage=3, pipeline_parallel_size=2, data_parallel_shard_size=2)
    om.ParallelConfig(zero_stage=2, context_parallel_size=2)
