"""``transformers.Trainer`` driving a (tensor-)parallel ``oslo_models`` model: the one-line setup.

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=2))
    model = peft.get_peft_model(model, adapters.lora_config(r=16, target_modules=["q_proj", "v_proj"]))
    trainer = om.training.Trainer(model=model, args=TrainingArguments(..., use_cpu=...), train_dataset=ds)
    trainer.train()                                  # under torchrun: every rank runs the same script

``om.training.Trainer`` is ``transformers.Trainer`` with :class:`ParallelTrainerMixin` in front; for another
``Trainer`` subclass (TRL's ``SFTTrainer``, your own) put the mixin first: ``class SFT(ParallelTrainerMixin,
SFTTrainer): pass`` (TRL's fused LM head, which would read only this rank's vocabulary shard, is replaced by the
same contract computed on the vocab-split logits: ``trl_head.py``; TRL's ``DPOTrainer``, ``GRPOTrainer`` and
``RLOOTrainer`` get their reference model at the policy's layout and their generation batch over the data-parallel
replicas: ``trl_trainers.py``). Plain ``transformers.Trainer`` under torchrun would treat every process as a data-parallel
replica: it wraps the model in DDP over the whole world (averaging the gradients of *different* tensor-parallel
shards) and gives every process its own batches (tensor-parallel ranks must see the *same* batch). The mixin changes
exactly those points, through ``Trainer``'s own overridable methods (nothing is patched):

- data: ``accelerator.prepare`` still builds the loaders (same sampler, seed, ``skip_first_batches`` on resume); the
  shard it makes is re-pointed at the data-parallel group (``num_processes = dp_size``, ``process_index =
  dp_rank``), so the tp ranks of a replica draw the same rows, as ``Trainer`` itself does for its rebalancing
  sampler.
- model and optimizer: autocast / compile from Accelerate (``prepare_model(evaluation_mode=True)``, which also marks
  the model prepared so ``Trainer`` does not wrap it again), then data parallelism over the dp group at the model's
  ``ParallelConfig.zero_stage`` (:func:`~oslo_models.training.zero.shard_data_parallel`): stage 0 is DDP; stages 1-3
  shard the optimizer ``Trainer`` created before wrapping (ZeRO-1: ``ZeroRedundancyOptimizer``; ZeRO-2/3: FSDP2,
  the optimizer rebuilt on the sharded parameters), which is then prepared here with ``device_placement=False``
  (Accelerate's placement round trip would ask ZeRO-1 for its consolidated state), as ``training.prepare`` does.
- loss: ``get_tp_size`` returns the model's tp size, so ``Trainer``'s token count (gathered over the world) and its
  loss scaling count each replica once: with ``average_tokens_across_devices`` (its default) the loss is the global
  batch's over the accumulation window, as ``training.prepare``'s loaders make it (``global_batch.py``); the logged
  loss (gathered over the world, averaged) is that global loss. ``model_accepts_loss_kwargs`` is set from the
  model's loss kind (token losses take ``num_items_in_batch``; sequence-level heads keep their per-row mean, which
  Trainer then neither rescales nor multiplies).
- gradient norm / clipping: :func:`~oslo_models.training.clip.clip_grad_norm_` (tp-split pieces summed over tp,
  LoRA adapters by their own layouts) in place of Accelerate's per-rank norm.
- checkpoints and ``save_model``: every rank joins the gathered save (``adapters.save_adapter`` for a ``peft``
  model: a plain ``peft`` folder; ``training.save_pretrained`` otherwise: a plain Hub folder); rank 0 writes. The
  optimizer state is per rank (``rank{r}-of-{world}-optimizer.pt``: tp ranks hold different adapter pieces; under
  ZeRO this rank's shard: ZeRO-1's partition, ZeRO-2/3's local pieces of the DTensor moments), the scheduler once;
  ``resume_from_checkpoint`` reloads them at the same layout and ZeRO stage (adapters and full weights themselves
  load at any layout, sliced).

Refused with the reason: pipeline and context parallelism (the schedule / the sequence split are not ``Trainer``'s
forward), and evaluation / prediction at tp > 1 (``Trainer`` gathers predictions over the whole world, so every tp
rank's copy would count).
"""
from __future__ import annotations

import os

import torch
import transformers

from ..utils.training_state import training_state
from . import clip
from .export import save_pretrained
from .global_batch import loss_is_per_token
from .trl_trainers import adapt_arguments, adapt_trainer, share_tp_rng
from .zero import shard_data_parallel, unwrap_model, unwrap_optimizer

OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _local_holder(optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: ZeRO-1's ``ZeroRedundancyOptimizer`` keeps its partition in
    ``.optim`` (its own ``state_dict`` would consolidate the whole state on one rank)."""
    inner = unwrap_optimizer(optimizer)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return inner.optim if isinstance(inner, ZeroRedundancyOptimizer) else inner


def _copy_hyperparameters(source, target) -> None:
    if source is not target:
        for group, other in zip(source.param_groups, target.param_groups, strict=True):
            other.update({key: value for key, value in group.items() if key != "params"})


def _local_optimizer_state(optimizer) -> dict:
    """This rank's optimizer state as plain tensors (ZeRO-2/3: the local shards of the DTensor moments)."""
    from torch.distributed.tensor import DTensor

    holder, inner = _local_holder(optimizer), unwrap_optimizer(optimizer)
    _copy_hyperparameters(inner, holder)  # ZeRO-1: the partition's groups get the scheduler's lr only at a step
    state = holder.state_dict()
    state["state"] = {index: {key: value.to_local() if isinstance(value, DTensor) else value
                              for key, value in entry.items()} for index, entry in state["state"].items()}
    return state


def _load_local_optimizer_state(optimizer, state: dict) -> None:
    """Inverse of :func:`_local_optimizer_state` at the same layout: the moments of a DTensor parameter become
    DTensors again on its mesh and placements."""
    from torch.distributed.tensor import DTensor

    holder = _local_holder(optimizer)
    holder.load_state_dict(state)
    _copy_hyperparameters(holder, unwrap_optimizer(optimizer))  # ZeRO-1 copies its own onto the partition's
    for param, entry in holder.state.items():
        if not isinstance(param, DTensor):
            continue
        local = param.to_local()
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == local.shape \
                    and value.dim():
                entry[key] = DTensor.from_local(value.to(local.device), param.device_mesh, param.placements,
                                                run_check=False, shape=param.shape, stride=param.stride())


class ParallelTrainerMixin:
    """Put first in the bases of a ``transformers.Trainer`` (sub)class; see the module docstring."""

    # ------------------------------------------------------------------ setup
    def __init__(self, *args, **kwargs):
        # TRL's DPO / GRPO / RLOO: the reference at the policy's layout, the generation batch over dp (trl_trainers.py)
        args, kwargs = adapt_arguments(super().__init__, kwargs.get("model", args[0] if args else None), args, kwargs)
        super().__init__(*args, **kwargs)
        context = self.parallel_context
        # Trainer hands num_items_in_batch to any forward with **kwargs and then multiplies the loss by the replica
        # count: right for a token loss divided by it (every native token head; the generic path's through
        # generic/token_loss.py), a gradient x dp for a sequence-level head that keeps its own per-row mean
        self.model_accepts_loss_kwargs = loss_is_per_token(self.model)
        if context.pp_size > 1:
            raise NotImplementedError(
                "Trainer with pipeline_parallel_size > 1 is not supported: the pipeline schedule (model.train_step) "
                "runs forward and backward together, Trainer calls forward then backward. Train with train_step in "
                "your own loop (oslo_models.training.prepare)")
        if context.cp_size > 1:
            raise NotImplementedError(
                "Trainer with context_parallel_size > 1 is not supported: Trainer's batches and token counts assume "
                "whole sequences on every rank")
        if self.accelerator.num_processes != context.world_size:
            raise ValueError(f"Accelerate sees {self.accelerator.num_processes} process(es) but the model's "
                             f"ParallelContext spans {context.world_size}")
        # TRL's trainers replaced the model's forward with a fused LM head that reads the head's weight, which is
        # this rank's vocabulary shard under tp: the same contract, on the model's vocab-split logits (trl_head.py)
        adapt_trainer(self)  # the policy's and the reference's heads too, at GRPO / RLOO's temperature
        if hasattr(self, "_tp_size"):  # TRL's trainers divide their world-wide token count (a metric) by it
            self._tp_size = context.tp_size

    def _generate_and_score_completions(self, *args, **kwargs):
        """TRL's GRPO / RLOO rollout: afterwards the tp ranks share tp rank 0's RNG state (``trl_trainers.py``), so
        they shuffle and split the rollout alike."""
        out = super()._generate_and_score_completions(*args, **kwargs)
        share_tp_rng(self.model)
        return out

    @property
    def parallel_context(self):
        inner = unwrap_model(self.model)
        context = getattr(inner, "parallel_context", None)
        if context is None:
            raise TypeError(f"{type(self).__name__} needs an oslo_models model (with .parallel_context), got "
                            f"{type(inner).__name__}; plain models train with transformers.Trainer")
        return context

    def get_tp_size(self) -> int:
        """Ranks that see the same batch within a replica: ``Trainer`` divides its world-wide token count by it."""
        return self.parallel_context.tp_size

    # ------------------------------------------------------------------ data
    def _get_dataloader(self, *args, **kwargs):
        loader = super()._get_dataloader(*args, **kwargs)
        context = self.parallel_context
        if context.world_size == 1:
            return loader
        from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard

        shard = getattr(loader, "batch_sampler", None)
        if not isinstance(shard, BatchSamplerShard):
            shard = getattr(loader, "dataset", None)
            if not isinstance(shard, IterableDatasetShard):
                raise NotImplementedError(
                    f"{type(self).__name__} splits batches over the data-parallel group by re-pointing Accelerate's "
                    f"shard, and found none in this {type(loader).__name__} (dispatch_batches=True or a custom "
                    "batch sampler); use a map-style or iterable dataset without dispatch_batches")
        shard.num_processes, shard.process_index = context.dp_size, context.dp_rank
        return loader

    # ------------------------------------------------------------------ model
    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not training or unwrap_model(model) is not model or training_state(model).zero_stage is not None:
            return model
        # autocast / compile only; marks the model prepared so Trainer's accelerator.prepare leaves it as is
        model = self.accelerator.prepare_model(model, evaluation_mode=True)
        stage = self.parallel_context.config.zero_stage
        if not stage:  # Trainer's accelerator.prepare wraps the optimizer afterwards, as for any model
            wrapped, _ = shard_data_parallel(model, None, zero_stage=0)
            return wrapped
        if self.optimizer is None:
            raise RuntimeError(f"zero_stage={stage}: {type(self).__name__} shards the optimizer with the model, and "
                               "Trainer created none before wrapping it")
        original = unwrap_optimizer(self.optimizer)
        wrapped, sharded = shard_data_parallel(model, original, zero_stage=stage)
        if self.lr_scheduler is not None and getattr(self.lr_scheduler, "optimizer", None) is original:
            self.lr_scheduler.optimizer = sharded  # ZeRO-2/3 rebuilt it on the sharded parameters (same groups)
        # prepared here (marked so, Trainer's accelerator.prepare keeps it); device_placement=False: the state is
        # where the parameters are, and Accelerate's placement round trip (state_dict -> load_state_dict) would need
        # ZeRO-1's consolidated state (training/prepare.py does the same)
        self.optimizer = self.accelerator.prepare(sharded, device_placement=[False])
        return wrapped

    def _clip_grad_norm(self, model):
        return clip.clip_grad_norm_(model, self.args.max_grad_norm, accelerator=self.accelerator, optimizer=self.optimizer)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # logged without clipping: still the whole model's norm
            grad_norm = clip.grad_norm(model)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ------------------------------------------------------------------ evaluation
    def _refuse_gathered_predictions(self, what: str) -> None:
        if self.parallel_context.tp_size > 1:
            raise NotImplementedError(
                f"Trainer.{what} at tensor_parallel_size > 1 is not supported: Trainer gathers losses and "
                "predictions over every process, so each tp rank's copy would be counted (and its last-batch trim "
                "would keep copies). Evaluate in your own loop, or at tp 1")

    def evaluate(self, *args, **kwargs):
        self._refuse_gathered_predictions("evaluate")
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._refuse_gathered_predictions("predict")
        return super().predict(*args, **kwargs)

    # ------------------------------------------------------------------ saving and resuming
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Every rank (``save_model`` calls ``_save`` on every rank): the gathered save, rank 0 writes."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        model = unwrap_model(self.model)
        if _is_peft(model):
            from ..adapters import save_adapter

            save_adapter(model, output_dir)
        else:
            save_pretrained(self.model, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _optimizer_file(self, folder: str) -> str:
        return os.path.join(folder, f"rank{self.args.process_index}-of-{self.args.world_size}-{OPTIMIZER_NAME}")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        torch.save(_local_optimizer_state(self.optimizer), self._optimizer_file(output_dir))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = self._optimizer_file(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: a checkpoint resumes at the layout (world size) that "
                                    "saved it; the model or adapter folder itself loads at any layout")
        _load_local_optimizer_state(self.optimizer, torch.load(path, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A ``peft`` model: ``Trainer``'s own path (``PeftModel.load_adapter``; the parallel LoRA layers slice the
        full tensors). A full model: each rank reads its slices of the Hub folder through the plan."""
        model = model if model is not None else self.model
        inner = unwrap_model(model)
        if _is_peft(inner):
            return super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        from ..conversion.checkpoint import CheckpointReader
        from ..conversion.loading import load_checkpoint_into

        load_checkpoint_into(inner, CheckpointReader.open(resume_from_checkpoint), plan=inner.parallel_plan,
                             context=inner.parallel_context, base_model_prefix=inner.base_model_prefix)


class Trainer(ParallelTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for ``oslo_models`` models at any tp x dp layout (see the module docstring)."""
