"""The generic path trains eight model types that have no native family exactly like single-process transformers.

Two spawned groups of 4 gloo processes (few spawned runs on purpose: 2 shared CPU cores), several models each:

- tp 2 x dp 2: granite (ZeRO-3), cohere (ZeRO-2, through ``training.prepare`` with Accelerate), olmoe (ZeRO-1);
- dp 4: stablelm (ZeRO-1), mpt (ZeRO-2), mamba (ZeRO-3 + CPU offload), megatron-bert MLM (ZeRO-3), xglm (DDP,
  Accelerate, activation checkpointing);

and for each: every rank holds exactly its shard after ``from_pretrained`` (its values, and storages of exactly
their size: no slice is a view into a whole tensor; the resident memory of a larger load is measured in
``test_generic_load_memory.py``), each of 3 AdamW
steps (clipped at 0.5) has the loss and gradient norm of the single-process run on the full global batch (fp32,
1e-5), and the parameters after 3 steps, read back with plain ``transformers`` from ``training.save_pretrained``,
equal the reference's. granite and olmoe also save a training checkpoint after step 2 at tp 2 x dp 2, which the dp 4
group resumes at another tp/dp/ZeRO layout (ZeRO-1 / ZeRO-3): step 3 and the final parameters match again.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models import training
from tests.generic.models import auto_class, save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.fake_hub import CopyingHub

STEPS, GLOBAL_BATCH, SEQ, MAX_NORM = 3, 4, 8, 0.5
TOL = dict(rtol=1e-5, atol=1e-5)
PARAM_TOL = dict(rtol=1e-4, atol=1e-5)  # Adam divides by sqrt(v): float noise of tiny gradients is amplified
TP_GROUP = {"granite": (3, False), "cohere": (2, False), "olmoe": (1, False)}  # name: (zero stage, cpu offload)
DP_GROUP = {"stablelm": (1, False), "mpt": (2, False), "mamba": (3, True), "megatron-bert": (3, False),
            "xglm": (0, False)}
THROUGH_ACCELERATE = {"cohere", "xglm"}
RESUMED = {"granite": 1, "olmoe": 3}  # saved at tp2 x dp2 after step 2, resumed at dp4 with this ZeRO stage


def batches():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 101, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def reference(path, name):
    """Single-process transformers on the global batches: losses, clipped norms, state after the last step."""
    model = auto_class(name).from_pretrained(path).train()
    opt = make_optimizer(model.parameters())
    losses, norms = [], []
    for ids in batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_shards(model, path, name, context):
    """Each rank holds its slice of every parameter (as the plan's placements say) and nothing more."""
    from torch.distributed.tensor import distribute_tensor

    full = dict(auto_class(name).from_pretrained(path).named_parameters())
    local_bytes = full_bytes = 0
    for pname, param in model.named_parameters():
        if hasattr(param, "placements"):
            expected = distribute_tensor(full[pname].detach(), param.device_mesh, param.placements,
                                         src_data_rank=None).to_local()
            local = param.to_local()
        else:
            expected, local = full[pname], param
        assert torch.equal(local.detach(), expected), pname
        local_bytes += local.numel() * local.element_size()
        full_bytes += full[pname].numel() * full[pname].element_size()
    # what the rank holds in memory: the storages behind its local tensors are exactly their size (no slice is a
    # view into a whole tensor kept alive behind it)
    storages = {}
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "placements") else param
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    assert sum(storages.values()) == local_bytes, (name, sum(storages.values()), local_bytes)
    if context.tp_size > 1:  # most weights are split: this rank holds about half
        assert local_bytes < 0.62 * full_bytes, (name, local_bytes, full_bytes)
        assert any(hasattr(p, "placements") for p in model.parameters())
    else:
        assert local_bytes == full_bytes


def _train(model, opt, context, steps, accelerator=None):
    losses, norms = [], []
    for step in steps:
        breadcrumb(f"step {step}")
        local = batches()[step].chunk(context.dp_size)[context.dp_rank]
        loss = model(local, labels=local).loss
        (accelerator.backward(loss) if accelerator is not None else loss.backward())
        if step == 0:
            local_norm = _local_only_norm(model)  # negative control: what one rank sees is not the model's norm
        norms.append(training.clip_grad_norm_(model, MAX_NORM))
        if step == 0 and (context.tp_size > 1 or training.zero_stage_of(model) >= 2):
            assert not torch.allclose(local_norm, norms[0], rtol=1e-3), (local_norm, norms[0])
        opt.step(), opt.zero_grad()
        mean = loss.detach().clone()
        if context.dp_group is not None:
            dist.all_reduce(mean, group=context.dp_group)
        losses.append(mean / context.dp_size)
    return losses, norms


def _local_only_norm(model):
    """The gradient norm of this rank's local pieces alone (what ``torch.nn.utils.clip_grad_norm_`` over local
    tensors would clip by)."""
    grads = [p.grad for p in training.unwrap_model(model).parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in local]))


def _check_saved(model, name, out, expected_state, context):
    training.save_pretrained(model, out)
    if context.rank == 0:
        plain = auto_class(name).from_pretrained(out)  # plain transformers, no conversion
        assert isinstance(training.unwrap_model(model), type(plain))  # FSDP2 subclasses the model's class
        state = plain.state_dict()
        assert state.keys() == expected_state.keys()
        for key, value in expected_state.items():
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{name} {k}: {m}", **PARAM_TOL)
    context.barrier()


def _group_worker(paths, cases, refs, tp, work, resume=False):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=tp))
    for name, (stage, offload) in cases.items():
        breadcrumb(f"{name}: load")
        ref_losses, ref_norms, ref_state = refs[name]
        parallel = context
        if name == "xglm":
            parallel = om.ParallelContext.from_config(om.ParallelConfig(activation_checkpointing="full"))
        model = auto_class(name, om).from_pretrained(paths[name], parallel=parallel)
        assert type(model).__module__.startswith("transformers.") and model.parallel_context is parallel
        assert model.is_activation_checkpointing == (name == "xglm")
        _check_shards(model, paths[name], name, context)
        model.train()
        opt = make_optimizer(model.parameters())
        if name in THROUGH_ACCELERATE:
            model, opt = training.prepare(accelerator, model, opt, zero_stage=stage, cpu_offload=offload)
        else:
            model, opt = training.shard_data_parallel(model, opt, zero_stage=stage, cpu_offload=offload)
        assert training.zero_stage_of(model) == stage
        accel = accelerator if name in THROUGH_ACCELERATE else None
        losses, norms = _train(model, opt, context, range(STEPS - 1), accel)
        if name in RESUMED:
            training.save_checkpoint(os.path.join(work, "ckpt", name), model, opt, step=STEPS - 1)
        more, more_norms = _train(model, opt, context, [STEPS - 1], accel)
        for step, (loss, norm) in enumerate(zip(losses + more, norms + more_norms)):
            torch.testing.assert_close(loss, ref_losses[step], msg=lambda m: f"{name} loss {step}: {m}", **TOL)
            torch.testing.assert_close(norm, ref_norms[step], msg=lambda m: f"{name} norm {step}: {m}", **TOL)
        _check_saved(model, name, os.path.join(work, "out", name), ref_state, context)
        del model, opt
    if resume:
        _resume(paths, refs, work, context)
        _push(paths, work, context)


def _resume(paths, refs, work, context):
    """Resume the tp 2 x dp 2 checkpoints at dp 4 with another ZeRO stage."""
    for name, stage in RESUMED.items():
        breadcrumb(f"{name}: resume")
        ref_losses, ref_norms, ref_state = refs[name]
        model = auto_class(name, om).from_pretrained(paths[name], parallel=context).train()
        model, opt = training.shard_data_parallel(model, make_optimizer(model.parameters()), zero_stage=stage)
        info = training.load_checkpoint(os.path.join(work, "ckpt", name), model, opt)
        assert info["step"] == STEPS - 1 and not info["same_layout"] and info["layout"]["tp"] == 2
        losses, norms = _train(model, opt, context, [STEPS - 1])
        torch.testing.assert_close(losses[0], ref_losses[-1], **TOL)
        torch.testing.assert_close(norms[0], ref_norms[-1], **TOL)
        _check_saved(model, name, os.path.join(work, "resumed", name), ref_state, context)


def _push(paths, work, context):
    model = om.AutoModelForCausalLM.from_pretrained(paths["mamba"], parallel=context)
    hub = CopyingHub(os.path.join(work, "hub"), folder_name=lambda _: f"rank{dist.get_rank()}")
    with mock.patch("huggingface_hub.HfApi", hub):
        result = training.push_to_hub(model, "me/tiny-mamba")
    assert (result == "uploaded me/tiny-mamba") == (context.rank == 0)


@pytest.mark.slow
def test_generic_types_train_like_transformers(tmp_path):
    names = [*TP_GROUP, *DP_GROUP]
    paths = save(tmp_path / "models", names)
    refs = {name: reference(paths[name], name) for name in names}
    work = str(tmp_path / "work")
    run_distributed(_group_worker, 4, paths, TP_GROUP, refs, 2, work, timeout=900)
    assert sorted(os.listdir(os.path.join(work, "ckpt"))) == sorted(RESUMED)
    run_distributed(_group_worker, 4, paths, DP_GROUP, refs, 1, work, True, timeout=900)
    assert os.listdir(os.path.join(work, "hub")) == ["rank0"]
    uploaded = transformers.MambaForCausalLM.from_pretrained(os.path.join(work, "hub", "rank0"))
    original = transformers.MambaForCausalLM.from_pretrained(paths["mamba"])
    for key, value in original.state_dict().items():
        assert torch.equal(uploaded.state_dict()[key], value), key
