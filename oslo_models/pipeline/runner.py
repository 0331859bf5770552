"""Run a pipelined model: ``torch.distributed.pipelining`` schedules over this project's stages.

``PipelineRunner(model).train_step(batch)`` is one training step on this data-parallel replica's batch
(``input_ids [b, s]``, ``labels`` and the family's other keys, e.g. ``attention_mask``; see the adapter): split into ``num_microbatches`` microbatches along the
batch, run through the configured schedule, gradients synchronized, loss returned on every rank.

Schedules (``ParallelConfig.pipeline_schedule``), all torch's, on ``PipelineStage`` with static shapes:

- ``"gpipe"``: ``ScheduleGPipe`` (all forwards, then all backwards);
- ``"1f1b"``: ``Schedule1F1B`` (PipeDream-flush; needs ``num_microbatches >= pp``);
- ``"interleaved_1f1b"``: ``ScheduleInterleaved1F1B`` over ``virtual_pipeline_size >= 2`` stages per rank;
- ``"zero_bubble"``: ``ScheduleInterleavedZeroBubble`` (ZB1P: the weight-gradient half of each backward fills
  the bubble), over ``virtual_pipeline_size`` stages per rank.

Loss scaling: the loss of microbatch ``i`` is ``sum of its token losses / D`` and torch's ``1/num_microbatches``
grad scaling is off. ``D`` is this replica's share of the global batch's label count (``training/global_batch.py``):
``max(N, 1) / dp`` with ``N`` the label tokens of every replica's batch (one all-reduce over dp x cp), or what the
batch's ``num_items_in_batch`` says (the loaders of ``training.prepare`` attach it, per rank: times ``cp`` here).
So the summed loss, averaged over dp, and the gradients equal the unpipelined model's mean loss on the global batch
exactly, also when microbatches and replicas hold different numbers of padding or prompt tokens.

Another objective (DPO, GRPO, distillation: ``oslo_models.post_training``) replaces the token loss through
``train_step(batch, loss_fn=fn, loss_inputs=rows)``: ``batch`` holds only the model's inputs, ``rows`` any per-row
tensors ``[b, ...]`` (targets, reference log-probabilities, advantages, teacher top-k). The schedule is given the row
indices ``arange(b)`` as its target, so it splits them into microbatches exactly as it splits the inputs; on the last
stage ``fn(local_logits, {name: rows[name][indices]})`` returns the microbatch's share of the global batch's loss
(its summed terms over this replica's share of the global divisor: the runner sums the microbatches and averages over
dp, no label count is taken). Not under context parallelism (a chunk holds part of each sequence).

Communication per step, besides the schedule's point-to-point sends of activations ``[mb, s(/tp), h]`` (and
their gradients) between neighbouring stages of one pipeline group:

- tied weights: one all-reduce (sum) of the gradient of each tied tensor over the ranks holding a copy (GPT-2:
  ``wte``/``lm_head`` between the first and last stage);
- data parallelism: one all-reduce (mean) of every local gradient over the data-parallel group (dp x cp under
  context parallelism); under ZeRO-2/3 (FSDP2 per stage, ``training/zero.py``) instead one reduce-scatter per step
  after the last microbatch, which torch's ``PipelineStage`` runs for an ``FSDPModule`` stage (the tied copies then
  sum their local shards);
- the loss: one all-reduce of the label count over dp x cp (unless the batch carries ``num_items_in_batch``), one
  broadcast from the last stage over the pipeline group and a mean over data parallelism; under context
  parallelism one all-reduce per microbatch of its loss over cp.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from ..utils.training_state import training_state, update_training_state
from .adapter import adapter_for
from .stage import StageModule, TiedCopies

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


def schedule_class(name: str):
    """The torch schedule class run for ``ParallelConfig.pipeline_schedule == name``."""
    if name not in SCHEDULE_CLASSES:
        raise ValueError(f"Unknown pipeline_schedule {name!r}; choose one of {tuple(SCHEDULE_CLASSES)}")
    return SCHEDULE_CLASSES[name]


class _LossFn:
    """``loss(local_logits, labels, num_items_in_batch)`` of one microbatch, on the last stage."""

    def __init__(self, model, num_microbatches: int):
        self.model, self.adapter, self.num_microbatches = model, adapter_for(model), num_microbatches
        self.scaler = None  # fp16: the step's GradScaler (set by train_step for the duration of one step)
        self.objective = None  # (fn, rows) of a train_step(loss_fn=..., loss_inputs=...), for one step

    def __call__(self, outputs, labels, num_items_in_batch=None):
        if self.objective is not None:  # ``labels``: the microbatch's row indices (see the module docstring)
            fn, rows = self.objective
            loss = fn(outputs, {name: tensor[labels] for name, tensor in rows.items()})
        else:
            loss = self.adapter.microbatch_loss(self.model, outputs, labels, num_items_in_batch,
                                                self.num_microbatches)
        if self.model.parallel_context.cp_size > 1:
            # this chunk's share of the whole sequence's loss: summed over cp (every cp rank of the last stage runs
            # the same schedule, so these all-reduces line up); backward x cp, which the dp x cp mean undoes
            from ..parallel_layers.context_parallel import sum_over_context

            loss = sum_over_context(loss, self.model.parallel_context)
        # fp16: the schedule backpropagates what this returns, so the loss scale goes in here, per microbatch
        # (GradScaler.scale: loss x scale, a power of two); train_step divides the recorded losses back
        return loss if self.scaler is None else self.scaler.scale(loss)


def _no_weight_step():
    return lambda: None


class PipelineRunner:
    """Owns the stages and schedules of one pipelined model (one per microbatch shape, built on first use).

    Collective at construction (the tied-embedding process groups) and in every step: call on every rank.
    """

    def __init__(self, model):
        self.model = model
        self.context = model.parallel_context
        config = self.context.config
        self.schedule_name = config.pipeline_schedule
        self.pipelined = self.context.pp_size > 1
        # Unpipelined (pp == 1), a step is the model's own forward + backward on the whole batch.
        self.num_microbatches = (config.num_microbatches or self.context.pp_size) if self.pipelined else 1
        self.layout = getattr(model, "pipeline_layout", None)
        self.adapter = adapter_for(model) if self.pipelined else None
        self.tied = TiedCopies(model, self.layout, self.context) if self.pipelined else None
        self.loss_fn = _LossFn(model, self.num_microbatches) if self.pipelined else None
        self._schedules: dict[tuple, object] = {}

    # ------------------------------------------------------------------ schedule construction
    def _schedule(self, batch: dict[str, torch.Tensor], training: bool):
        key = (tuple((name, tuple(tensor.shape)) for name, tensor in sorted(batch.items())), training)
        if key not in self._schedules:
            self._schedules[key] = self._build_schedule(batch, training)
        return self._schedules[key]

    def _build_schedule(self, batch: dict[str, torch.Tensor], training: bool):
        model, context, layout, adapter = self.model, self.context, self.layout, self.adapter
        sp = adapter.use_sequence_parallel(model, batch)
        microbatch = {name: torch.empty((tensor.shape[0] // self.num_microbatches, *tensor.shape[1:]),
                                        dtype=tensor.dtype, device="meta") for name, tensor in batch.items()}

        def meta(tensors):  # activations need grad in training: torch sizes and sends their gradients
            return tuple(t.detach().requires_grad_(training and t.is_floating_point()) for t in tensors)

        stages = []
        whole_backward = adapter.whole_backward_stages(model, layout)
        state = training_state(model)  # ZeRO-2/3: stage_modules are the FSDP2 roots, one per local stage
        sharded = state.stage_modules
        if sharded is not None and (state.zero_stage or 0) >= 3:
            # ZeRO-3 reshards a layer's parameters between the split backward's input pass and its weight pass,
            # so the weight pass would miss them: every stage runs its backward whole (zero-bubble gives up the
            # split, not correctness; ZeRO-2 keeps parameters gathered and keeps it)
            whole_backward = set(layout.local_stages)
        for stage_index in layout.local_stages:
            if sharded is not None:
                module = sharded[stage_index]  # its sequence_parallel is set before each step (_run)
            else:
                module = StageModule(model, stage_index, layout, sequence_parallel=sp)
            # Static shapes: no shape-inference forward (which would run the TP collectives on empty tensors).
            inputs, outputs = adapter.stage_io(model, layout, stage_index, microbatch, sp)
            # A dw_builder makes torch run the stage's whole backward at once; the weight step is then a no-op.
            dw_builder = _no_weight_step if stage_index in whole_backward else None
            stages.append(PipelineStage(module, stage_index, layout.num_stages, context.device,
                                        input_args=meta(inputs), output_args=meta(outputs), group=context.pp_group,
                                        dw_builder=dw_builder))
        cls = schedule_class(self.schedule_name)
        loss_fn = self.loss_fn
        if self.schedule_name in MULTI_STAGE_SCHEDULES:
            return cls(stages, self.num_microbatches, loss_fn=loss_fn, scale_grads=False), sp
        return cls(stages[0], self.num_microbatches, loss_fn=loss_fn, scale_grads=False), sp

    # ------------------------------------------------------------------ steps
    def _prepare(self, batch, labels, attention_mask, objective: bool = False) -> dict[str, torch.Tensor]:
        """The batch as a dict of device tensors, completed by the adapter; ``ValueError`` on bad input."""
        if not isinstance(batch, Mapping):
            batch = {"input_ids": batch}
        batch = {name: tensor for name, tensor in batch.items() if tensor is not None}
        if labels is not None:
            batch["labels"] = labels
        if attention_mask is not None:
            batch["attention_mask"] = attention_mask
        accepted = self.adapter.batch_keys if self.pipelined else None
        if accepted is not None and set(batch) - set(accepted):
            raise ValueError(f"Pipelined {type(self.model).__name__} batches take {list(accepted)}; got unknown "
                             f"{sorted(set(batch) - set(accepted))}")
        if not objective and not {"labels", "shift_labels", "start_positions"} & set(batch):  # (QA: positions)
            raise ValueError("A pipeline step computes the loss: pass labels (or a batch with 'labels')")
        input_ids = batch.get("input_ids")
        # [batch, seq]; [batch, choices, seq] for a multiple-choice head (its adapter flattens the choices)
        dims = getattr(getattr(type(self.model), "pipeline_adapter", None), "input_ids_dims", 2)
        if input_ids is None or input_ids.ndim != dims:
            raise ValueError(f"input_ids must be [{'batch, choices, seq' if dims == 3 else 'batch, seq'}], got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        if input_ids.shape[0] % self.num_microbatches:
            raise ValueError(f"The batch of {input_ids.shape[0]} sequences is not divisible by num_microbatches="
                             f"{self.num_microbatches}; use a batch size that is a multiple of it")
        device = self.context.device
        batch = {name: tensor.to(device) for name, tensor in batch.items()}
        return self.adapter.prepare_batch(self.model, batch) if self.pipelined else batch

    def _loss_share(self, batch) -> torch.Tensor | None:
        """This rank's share of the global label count when the batch carries none (see the module docstring):
        the unpipelined model's convention (summed over cp by the model), or ``None`` for a sequence-level loss."""
        from ..training.global_batch import count_label_tokens, global_share, loss_is_per_token, loss_shifts_labels

        if self.pipelined:
            labels = batch["labels"]  # under cp: this chunk's targets, already shifted (prepare_batch)
            local = torch.as_tensor(self.adapter.loss_items(self.model, labels) if self.context.cp_size == 1
                                    else int((labels != -100).sum()))
        else:
            if not loss_is_per_token(self.model):
                return None
            local = count_label_tokens([batch], shifts_labels=loss_shifts_labels(self.model))
            if local is None:
                return None
        return global_share(local, self.context)

    def _run(self, batch, labels, attention_mask, training: bool, objective=None) -> torch.Tensor:
        batch = dict(batch) if isinstance(batch, Mapping) else batch
        share = batch.pop("num_items_in_batch", None) if isinstance(batch, dict) else None
        if objective is not None:
            if not self.pipelined or self.context.cp_size > 1 or labels is not None or (
                    isinstance(batch, dict) and "labels" in batch):
                raise ValueError("train_step(loss_fn=...) runs a pipelined model's own objective at cp 1 on a batch "
                                 "of model inputs (no labels: the per-row tensors go in loss_inputs)")
            batch = self._prepare(batch, None, attention_mask, objective=True)
            rows = batch["input_ids"].shape[0]
            bad = [name for name, tensor in objective[1].items() if tensor.shape[0] != rows]
            if bad:
                raise ValueError(f"loss_inputs {bad} do not hold the batch's {rows} rows")
            batch["labels"] = torch.arange(rows, device=self.context.device)  # the target: row indices
            self.loss_fn.objective = (objective[0], {name: tensor.to(self.context.device)
                                                     for name, tensor in objective[1].items()})
            share = torch.ones((), device=self.context.device)  # unused by the objective
        else:
            batch = self._prepare(batch, labels, attention_mask)
        if share is None:
            share = self._loss_share(batch)
        if not self.pipelined:
            if share is not None:
                batch["num_items_in_batch"] = share
            return self._run_unpipelined(batch, training)
        schedule, sp = self._schedule(batch, training)
        for module in (training_state(self.model).stage_modules or {}).values():
            module.sequence_parallel = sp  # shared FSDP2 stage modules serve every batch shape
        layout, adapter = self.layout, self.adapter
        labels = batch.pop("labels")
        args = tuple(batch.pop(name) for name in adapter.first_inputs)
        if not layout.has_first:
            args = ()
        target = labels if layout.has_last else None
        losses: list[torch.Tensor] = []
        # the replica's divisor: the per-rank shares of its cp ranks summed (they are equal)
        loss_kwargs = {"num_items_in_batch": share.to(self.context.device) * self.context.cp_size}
        if training:
            schedule.step(*args, target=target, losses=losses, return_outputs=False, loss_kwargs=loss_kwargs,
                          **batch)
        else:
            with torch.no_grad():
                schedule.eval(*args, target=target, losses=losses, loss_kwargs=loss_kwargs, **batch)
        loss = (torch.stack(losses).sum().detach().float() if layout.has_last
                else torch.zeros((), dtype=torch.float32, device=self.context.device))
        if training and self.loss_fn.scaler is not None and layout.has_last:
            loss = loss / self.loss_fn.scaler.get_scale()  # the recorded losses were scaled (exact: a power of 2)
        dist.broadcast(loss, src=dist.get_global_rank(self.context.pp_group, layout.last_rank),
                       group=self.context.pp_group)
        if self.context.dp_size > 1:
            dist.all_reduce(loss, group=self.context.dp_group)
            loss /= self.context.dp_size
        return loss

    def _run_unpipelined(self, batch, training: bool) -> torch.Tensor:
        with torch.set_grad_enabled(training):
            loss = self.model(**batch).loss
        if training:
            scaler = getattr(self, "_scaler", None)
            (loss if scaler is None else scaler.scale(loss)).backward()
        loss = loss.detach().float()
        if self.context.dp_size > 1:
            dist.all_reduce(loss, group=self.context.dp_group)
            loss /= self.context.dp_size
        return loss

    def train_step(self, batch, *, labels=None, attention_mask=None, optimizer=None, scaler=None, loss_fn=None,
                   loss_inputs=None) -> torch.Tensor:
        """Forward and backward of one batch through the schedule; returns the mean loss on every rank.

        ``loss_fn(local_logits, microbatch_rows) -> loss`` with ``loss_inputs`` (per-row tensors): another objective
        on the last stage instead of the token loss (see the module docstring).

        Gradients accumulate into ``.grad`` (tied copies summed, data-parallel replicas averaged). With
        ``optimizer``, also runs ``optimizer.step()`` and ``optimizer.zero_grad()``.

        fp16 (``scaler``: a ``torch.amp.GradScaler``; default the one ``training.prepare`` took from an fp16
        ``Accelerator``): every microbatch's loss is multiplied by the scale inside the schedule, so the gradients
        come out scaled like ``scaler.scale(loss).backward()`` leaves them; the returned loss is unscaled. Then, as
        after any scaled backward: ``scaler.unscale_(optimizer)``, ``training.sync_overflow(scaler, context)`` (all
        ranks skip together: each pipeline rank sees only its stages' gradients), ``scaler.step(optimizer)``,
        ``scaler.update()`` - which this method runs itself when given ``optimizer``.
        """
        self._check_dtype()
        scaler = scaler if scaler is not None else training_state(self.model).grad_scaler
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None:
            # the scale lives lazily in the scaler: make it on every rank (unscale_ needs it on stages without loss)
            scaler.scale(torch.zeros((), device=self.context.device))
        if self.pipelined:
            self.loss_fn.scaler = scaler
        self._scaler = scaler
        try:
            objective = None if loss_fn is None else (loss_fn, dict(loss_inputs or {}))
            loss = self._run(batch, labels, attention_mask, training=True, objective=objective)
        finally:
            self._scaler = None
            if self.pipelined:
                self.loss_fn.scaler = self.loss_fn.objective = None
        self.sync_gradients()
        if optimizer is not None:
            if scaler is not None:
                from ..training.mixed_precision import sync_overflow

                scaler.unscale_(optimizer)
                sync_overflow(scaler, self.context)
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad()
        return loss

    def _check_dtype(self) -> None:
        if self.pipelined and any(p.dtype == torch.float16 for p in self.model.parameters()):
            # fp16 *weights*: GradScaler refuses to unscale fp16 gradients and there are no fp32 master weights, so
            # small updates would underflow silently. Mixed precision keeps fp32 weights (supported, see train_step).
            raise NotImplementedError("training a pipelined model with float16 weights is not implemented (no fp32 "
                                      "master weights to apply the unscaled step to); keep float32 weights and use "
                                      "mixed_precision='fp16' (autocast + loss scaling), or bfloat16")

    @torch.no_grad()
    def eval_step(self, batch, *, labels=None, attention_mask=None) -> torch.Tensor:
        """Forward only through the schedule; returns the mean loss on every rank."""
        return self._run(batch, labels, attention_mask, training=False)

    # ------------------------------------------------------------------ gradients
    def _expert_parameters(self) -> dict:
        """This stage's parameters split over the expert-parallel group (none at ep 1), by id: those the model
        protocol's expert units hold (a native family's stacked experts; on the generic path the DTensors split
        over the ``ep`` mesh dimension)."""
        if self.context.ep_size == 1:
            return {}
        from ..utils.model_protocol import protocol_of

        def split(param) -> bool:  # a DTensor held by an expert unit beside its experts (none split over ep)
            mesh = getattr(param, "device_mesh", None)
            return mesh is None or "ep" in (mesh.mesh_dim_names or ())

        units = protocol_of(self.model).expert_units(self.model)
        return {id(param): param for unit in units for param in unit.parameters(recurse=False) if split(param)}

    def sync_gradients(self) -> None:
        """Sum the tied embedding's gradient over its two copies; average every gradient over data parallel (dp x
        cp under context parallelism: cp ranks hold the same weights, each gradient ``cp`` x its chunk's share; under
        ZeRO-2/3 the schedule already reduce-scattered them: the tied copies sum their shards)."""
        if self.tied is not None:
            self.tied.sum_gradients()
        if self.context.dp_cp_size > 1 and training_state(self.model).stage_modules is None:
            experts = self._expert_parameters()
            # a DTensor parameter (the generic path's tensor-parallel plan): its local shard's gradient
            grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                     for p in self.model.parameters() if p.grad is not None and id(p) not in experts]
            for param in experts.values():  # split over ep: summed over edp (the ranks of dp x cp holding the same
                if param.grad is not None:  # experts), then / (dp x cp) like the dense mean (expert_parallel.py)
                    grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                    if self.context.edp_group is not None and self.context.edp_size > 1:
                        dist.all_reduce(grad, group=self.context.edp_group)
                    grad.div_(self.context.dp_cp_size)
            if grads:
                flat = torch._utils._flatten_dense_tensors(grads)
                dist.all_reduce(flat, group=self.context.dp_cp_group)
                flat /= self.context.dp_cp_size
                for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    grad.copy_(synced)


def pipeline_runner(model) -> PipelineRunner:
    """The :class:`PipelineRunner` of a pipelined ``model`` (native or generic path), built on first use (it
    creates process groups: every rank calls it) and kept in the model's ``TrainingState.pipeline_runner``: no
    global state."""
    runner = training_state(model).pipeline_runner
    if runner is None:
        runner = PipelineRunner(model)
        update_training_state(model, pipeline_runner=runner)
    return runner
