"""``prepare``: what ``accelerator.prepare`` does, made right for a model with tensor parallelism inside.

``accelerator.prepare(model)`` wraps the model in DDP over the *whole* world, which would average gradients across
tensor-parallel ranks (they hold different shards: wrong), and ``accelerator.prepare(dataloader)`` shards batches
over the world instead of over the data-parallel group (tensor-parallel ranks must see the *same* batch). Use::

    accelerator = Accelerator(cpu=..., mixed_precision="bf16", gradient_accumulation_steps=2)
    model = om.AutoModelForCausalLM.from_pretrained(name, parallel=om.ParallelConfig(tensor_parallel_size=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loader = om.data.build_dataloader(ds, batch_size=8, parallel_context=model.parallel_context)
    model, optimizer, loader, scheduler = om.training.prepare(accelerator, model, optimizer, loader, scheduler,
                                                              zero_stage=2)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                om.training.clip_grad_norm_(model, 1.0, accelerator=accelerator)
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

What each piece becomes:

- model: Accelerate applies what is layout-independent (autocast for bf16/fp16, ``torch.compile`` if configured,
  device placement) through ``accelerator.prepare_model(model, evaluation_mode=True)`` - the documented mode that
  does exactly that and no wrapping -, then :func:`~oslo_models.training.zero.shard_data_parallel` wraps it over the
  dp group only (DDP, ZeRO-1, FSDP2 ZeRO-2/3, CPU offload).
- optimizer: sharded as the ZeRO stage says, then ``accelerator.prepare_optimizer`` (loss scaling, skipping the
  step on non-sync micro-batches of gradient accumulation).
- data loaders: an ``oslo_models.data`` loader is already split by dp rank; any other ``DataLoader`` is split by
  Accelerate's ``prepare_data_loader`` with ``num_processes=dp_size`` and ``process_index=dp_rank``, so every tp
  rank of a replica gets the same batches. Either is returned inside a ``GlobalBatchLoader`` (``global_batch.py``):
  it attaches ``num_items_in_batch``, so the step's loss is the global batch's (its label tokens counted over every
  replica and accumulation micro-step, one all-reduce per step), and at cp > 1 it splits full sequences into this
  rank's chunks when the loader did not.
- schedulers: Accelerate's ``AcceleratedScheduler`` with ``split_batches=True``: one scheduler step per optimizer
  step (skipped with it on fp16 overflow), not one per process (Accelerate's default multiplies by the world size,
  which counts tp ranks as if they were data-parallel).

Pipelined models (``pipeline_parallel_size > 1``) train with ``loss = model.train_step(batch)`` in place of forward
and ``accelerator.backward``; they are not wrapped (the runner all-reduces gradients over dp), ZeRO-1 shards the
optimizer and ZeRO-2/3 make each stage an FSDP2 root (``zero.py``); Accelerate's bf16 autocast runs inside each
stage's forward (``pipeline/stage.py``); fp16 too, with Accelerate's GradScaler scaling each microbatch's loss inside
the schedule (``train_step``; then ``clip_grad_norm_`` or ``sync_overflow`` and the optimizer's step as usual);
gradient accumulation is refused with a clear error before anything is wrapped.

Collectives: none here beyond what DDP/FSDP2 run at construction (a parameter broadcast/none); the loaders run one
all-reduce of a scalar per optimizer step.
"""
from __future__ import annotations

import warnings

import torch

from ..utils.training_state import update_training_state
from .layout_rules import check_training_layout
from .mixed_precision import check_mixed_precision
from .zero import shard_data_parallel, unwrap_model


def _context_of(model):
    context = getattr(unwrap_model(model), "parallel_context", None)
    if context is None:
        raise ValueError(f"oslo_models.training.prepare needs an oslo_models model (with .parallel_context); got "
                         f"{type(model).__name__}. Plain models go through accelerator.prepare.")
    return context


def _check_world(accelerator, context) -> None:
    if accelerator.num_processes != context.world_size:
        raise ValueError(
            f"Accelerate sees {accelerator.num_processes} process(es) but the model's ParallelContext spans "
            f"{context.world_size}. On a machine without GPUs launch with `ACCELERATE_USE_CPU=1 accelerate launch "
            f"--multi_gpu --num_processes N` or build `Accelerator(cpu=True)` under torchrun.")
    check_accelerate_mode(accelerator)


def check_accelerate_mode(accelerator) -> None:
    """``ValueError`` for an Accelerate mode ``prepare`` does not drive, before anything is wrapped: ``prepare``
    wraps the model itself (DDP / ZeRO-1 / FSDP2 over the data-parallel group only), so Accelerate's own FSDP,
    DeepSpeed or Megatron-LM plugin would either shard over the whole world (tensor-parallel ranks included) or be
    silently ignored (a step that trains nothing the plugin promised)."""
    kind = str(accelerator.distributed_type)
    if "FSDP" in kind:
        raise ValueError("Do not configure Accelerate's FSDP plugin for an oslo_models model: pass zero_stage=2/3 "
                         "to oslo_models.training.prepare, which shards over the data-parallel group only")
    if "DEEPSPEED" in kind:
        raise ValueError("Accelerate's DeepSpeed plugin is not driven by oslo_models.training.prepare (its ZeRO would "
                         "shard over the whole world, tensor-parallel ranks included, or be ignored): launch without it "
                         "and pass zero_stage=1/2/3 (and cpu_offload=True) to prepare instead")
    if "MEGATRON" in kind:
        raise ValueError("Accelerate's Megatron-LM plugin is not driven by oslo_models.training.prepare: the model "
                         "already is tensor/pipeline-parallel through ParallelConfig; launch without the plugin")


def _splits_context(loader) -> bool:
    """Whether ``loader``'s collate function already keeps this cp rank's chunks (``build_dataloader`` with a
    context, or a ``ContextParallelSplitter`` as the collate function or inside ``build_dataloader``'s chain)."""
    from ..data.collators.context_parallel import ContextParallelSplitter

    collate = getattr(loader, "collate_fn", None)
    while collate is not None:
        if isinstance(collate, ContextParallelSplitter) or isinstance(getattr(collate, "splitter", None),
                                                                       ContextParallelSplitter):
            return True
        collate = getattr(collate, "collate", None)
    return False


def _prepare_dataloader(accelerator, loader, context, model, average_tokens_across_devices: bool):
    from ..data.collators.context_parallel import ContextParallelSplitter
    from ..data.loader import ResumableDataLoader
    from .global_batch import GlobalBatchLoader, loss_is_per_token, loss_shifts_labels

    if isinstance(loader, ResumableDataLoader):
        if loader.sampler.dp_size != context.dp_size or loader.sampler.dp_rank != context.dp_rank:
            raise ValueError(f"the data loader is split for dp_rank={loader.sampler.dp_rank}/{loader.sampler.dp_size}"
                             f" but the model's context has dp_rank={context.dp_rank}/{context.dp_size}; build it "
                             f"with parallel_context=model.parallel_context")
        inner = loader
    else:
        from accelerate.data_loader import prepare_data_loader

        inner = prepare_data_loader(loader, accelerator.device, num_processes=context.dp_size,
                                    process_index=context.dp_rank, split_batches=False, put_on_device=True,
                                    rng_types=None, dispatch_batches=False, even_batches=True,
                                    use_seedable_sampler=False)
    shifts, token_loss = loss_shifts_labels(model), loss_is_per_token(model)
    if average_tokens_across_devices and not token_loss and context.dp_cp_size > 1 and _has_token_labels(model):
        warnings.warn(f"{type(unwrap_model(model)).__name__}'s loss is not a token cross-entropy over "
                      "num_items_in_batch: it is averaged per data-parallel replica, not over the global batch's "
                      "label tokens (docs/training.md)", stacklevel=3)
    # a plain DataLoader of full sequences works at cp > 1: this rank's chunks, targets shifted on the full sequence
    split = (ContextParallelSplitter(context, shift_labels=shifts)
             if context.cp_size > 1 and not _splits_context(loader) else None)
    return GlobalBatchLoader(inner, context=context, shifts_labels=shifts,
                             accumulation_steps=accelerator.gradient_accumulation_steps,
                             average_tokens_across_devices=average_tokens_across_devices, split=split,
                             token_loss=token_loss)


def _has_token_labels(model) -> bool:
    """A pre-training head whose token loss is of its own kind (BERT / ALBERT ``ForPreTraining``, ELECTRA)."""
    return type(unwrap_model(model)).__name__.endswith("ForPreTraining")


def prepare(accelerator, model, *objects, zero_stage: int | None = None, cpu_offload: bool = False,
            average_tokens_across_devices: bool = True, **ddp_kwargs):
    """``accelerator.prepare`` for an ``oslo_models`` model: data parallelism over the dp group only.

    Args:
        accelerator: an ``accelerate.Accelerator`` whose world equals the model's (``ValueError`` otherwise).
        model: the (tensor-)parallel model, not wrapped yet.
        objects: any of: one optimizer over ``model.parameters()`` (fresh), data loaders, LR schedulers (built on
            that optimizer). Returned in the same order, after the model, like ``accelerator.prepare``.
        zero_stage: 0 (DDP), 1, 2, 3; default ``model.parallel_context.config.zero_stage``.
        cpu_offload: stages 2/3: parameters, gradients and optimizer state in host memory (the same as
            ``ParallelConfig.offload="cpu"``). ``ParallelConfig.offload="nvme"`` (stages 0/2/3) returns a
            ``DiskOffloadedOptimizer``: the Adam state on disk under ``offload_path`` (``nvme_offload.py``).
        average_tokens_across_devices: the loss of an optimizer step is the summed token losses of the whole global
            batch (every dp replica, cp chunk and accumulation micro-step) over its label count, as ``transformers``'
            Trainer, torchtitan and Megatron compute it (``global_batch.py``): the returned loaders attach
            ``num_items_in_batch`` to every batch. ``False``: DDP's classic mean of per-replica means.
    """
    context = _context_of(model)
    _check_world(accelerator, context)
    check_training_layout(context.config, zero_stage=zero_stage, cpu_offload=cpu_offload,
                          mixed_precision=check_mixed_precision(accelerator),
                          gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                          compiled=getattr(model, "_orig_mod", None) is not None)
    optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
    if len(optimizers) > 1:
        raise ValueError("pass at most one optimizer (one model, one optimizer)")
    # Autocast, compile and placement only: Accelerate must not wrap the model in world-wide DDP.
    model = accelerator.prepare_model(model, evaluation_mode=True)
    if context.pp_size > 1 and str(accelerator.mixed_precision) in ("bf16", "fp16"):
        # The schedule runs the stages, not model.forward (which Accelerate wrapped): each stage autocasts itself;
        # fp16: train_step scales every microbatch's loss with Accelerate's GradScaler (pipeline/runner.py)
        fp16 = str(accelerator.mixed_precision) == "fp16"
        update_training_state(model, autocast_dtype=torch.float16 if fp16 else torch.bfloat16,
                              grad_scaler=accelerator.scaler if fp16 else None)
    model, sharded = shard_data_parallel(model, optimizers[0] if optimizers else None, zero_stage=zero_stage,
                                         cpu_offload=cpu_offload, **ddp_kwargs)
    # device_placement=False: the state is already where the parameters are, and Accelerate's placement round trip
    # (state_dict -> load_state_dict) would need ZeRO-1's consolidated global state.
    prepared_optimizer = (accelerator.prepare_optimizer(sharded, device_placement=False) if sharded is not None
                          else None)

    from accelerate.scheduler import AcceleratedScheduler

    out = []
    for obj in objects:
        if isinstance(obj, torch.optim.Optimizer):
            out.append(prepared_optimizer)
        elif isinstance(obj, torch.utils.data.DataLoader):
            out.append(_prepare_dataloader(accelerator, obj, context, model, average_tokens_across_devices))
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            if prepared_optimizer is None:
                raise ValueError("a scheduler needs its optimizer in the same prepare call")
            if obj.optimizer is not optimizers[0]:
                raise ValueError("the scheduler must be built on the optimizer passed to prepare")
            # The scheduler adjusts lr on the param groups of the optimizer it was built on; ZeRO-1/FSDP2 may have
            # built a new optimizer, so point it there (same groups, same order).
            obj.optimizer = sharded
            scheduler = AcceleratedScheduler(obj, prepared_optimizer, step_with_optimizer=True, split_batches=True)
            out.append(scheduler)
        else:
            raise ValueError(f"prepare does not know what to do with a {type(obj).__name__}")
    return (model, *out)
