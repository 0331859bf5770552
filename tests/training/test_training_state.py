"""What ``prepare`` / ZeRO / asynchronous checkpoints set on a model is one named record, ``training_state(model)``
(``utils/training_state.py``), never a private ``_oslo_*`` attribute.

4 ranks, tiny GPT-2 (hidden 64, 2 layers, vocab 101): tp2 x dp2 ZeRO-3 with Accelerate's bf16, one AdamW step and an
asynchronous save; then pp2 x dp2 ZeRO-3 bf16 (the stages' autocast dtype, FSDP2 stage roots, pipeline runner).
After each, no submodule of the model (nor its wrapper) holds an attribute named ``_oslo_*``, and ``training_state``
reports what was set, the same through the model and its wrapper.
Negative control: a planted ``_oslo_`` attribute is found; an unprepared model reports every field unset. (Losses and
parameters of these layouts against ``transformers`` are asserted by test_clip_norms_and_zero_structure,
test_pipeline_mixed_precision and test_async_checkpoint.)"""
from __future__ import annotations

import torch
import torch.distributed as dist

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from oslo_models.training.async_checkpoint import AsyncWriter
from tests.helpers.dist import run_distributed
from tests.helpers.models import save_tiny_gpt2
from tests.helpers.pipeline import ADAMW


def _private_flags(*models) -> list[str]:
    """``module path.attribute`` for every ``_oslo_*`` attribute in the ``vars`` of any submodule of ``models``."""
    found = []
    for model in models:
        for prefix, module in model.named_modules():
            found += [f"{prefix}.{key}" for key in vars(module) if key.startswith("_oslo_")]
    return found


def _prepare(path, accelerator, **parallel):
    cfg = om.ParallelConfig(zero_stage=3, **parallel)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    unprepared = training.training_state(model)
    assert unprepared == training.TrainingState() and unprepared.zero_stage is None  # control: nothing set yet
    return training.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), **ADAMW))


def _worker(path: str, root: str) -> None:
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    ids = torch.randint(1, 101, (4, 16), generator=torch.Generator().manual_seed(5))

    model, opt = _prepare(path, accelerator, tensor_parallel_size=2)
    inner = training.unwrap_model(model)
    ctx = inner.parallel_context
    local = ids.chunk(ctx.dp_size)[ctx.dp_rank]
    accelerator.backward(model(local, labels=local).loss)
    opt.step(), opt.zero_grad()
    training.save_checkpoint(root, model, opt, step=1, async_=True)
    assert training.wait_for_checkpoint(model).endswith("step-00000001")
    assert _private_flags(model, inner) == []
    state = training.training_state(model)
    assert state is training.training_state(inner)  # one record, seen through the wrapper
    assert state.zero_stage == 3 and training.zero_stage_of(model) == 3
    assert dist.get_world_size(state.fsdp_shard_group) == 2  # FSDP2 shards over dp
    assert isinstance(state.async_writer, AsyncWriter)
    assert state.gradients_reduced_by == "fsdp2 zero3" == om.distributed.gradients_reduced_by(model)
    # not pipelined: Accelerate's wrapper of forward autocasts, the stages are not asked to
    assert state.autocast_dtype is None and state.grad_scaler is None and state.stage_modules is None

    piped, _ = _prepare(path, accelerator, pipeline_parallel_size=2, num_microbatches=2)
    state = training.training_state(piped)
    assert state.zero_stage == 3 and state.autocast_dtype == torch.bfloat16 and state.grad_scaler is None
    assert sorted(state.stage_modules) == list(piped.pipeline_layout.local_stages)
    assert state.gradients_reduced_by == "fsdp2 zero3" and state.pipeline_runner is None
    dp = piped.parallel_context
    rows = ids.chunk(dp.dp_size)[dp.dp_rank]
    assert torch.isfinite(piped.train_step({"input_ids": rows, "labels": rows}))
    assert training.training_state(piped).pipeline_runner is not None  # built by the first train_step
    assert _private_flags(piped, training.unwrap_model(piped)) == []

    # Negative control: an attribute set the old way is found.
    training.unwrap_model(model).transformer.h[0]._oslo_zero_stage = 3
    assert _private_flags(model) == ["transformer.h.0._oslo_zero_stage"]


def test_prepare_sets_only_the_training_state(tmp_path):
    path = save_tiny_gpt2(tmp_path / "gpt2", n_embd=64, n_layer=2, vocab_size=101)
    run_distributed(_worker, 4, path, str(tmp_path / "ckpt"))
