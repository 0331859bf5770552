"""The pipeline adapter of a generic causal LM: how the pipeline engine (``oslo_models/pipeline``) runs
``transformers``' own class stage by stage, with every schedule of the native models (GPipe, 1F1B, interleaved 1F1B,
zero-bubble).

    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=4, pipeline_schedule="1f1b")
    model = om.AutoModelForCausalLM.from_pretrained("path/to/new-decoder", parallel=cfg)  # no native family
    loss = model.train_step(batch)     # the schedule; loss on every rank (as on a native pipelined model)

What a stage computes: ``transformers``' forward of the whole model (``type(model).forward``) over the stage's view
of the layers (``pipeline_cut.py``): the decoder embeds the tokens (first stage) or the stand-in's zeros (others),
computes the position ids, the rotary embeddings and the mask of each layer type from the microbatch's
``input_ids`` / ``attention_mask`` exactly as it does unpipelined, and calls every layer with the keyword arguments
it always gives them; the probe before the stage's first layer hands it the activations received from the previous
stage, the probe after its last layer stops the forward. The last stage runs to the end: final norm, head and the
model's own logit scaling / soft-capping; its output is the logits ``[mb, s, V]`` (under tensor parallelism this rank's
vocabulary slice ``[mb, s, V/tp]``, the head applied colwise), and the loss is ``transformers``' causal-LM loss on
them over the global batch's label count (``pipeline/runner.py``). Between stages flows ``[mb, s, h]``.

With the other axes: under sequence parallelism ``[mb, s/tp, h]`` flows between stages (the first stage cuts the
sequence at the model's first layer, the last gathers it after its last: ``sequence_parallel.install``); under
context parallelism each stage holds the rank's chunk(s) ``[mb, s/cp, h]`` and applies
``context_parallel.chunk_inputs`` itself (global positions, the ``ContextParallelMask``: one all-gather of the padding
mask over cp per stage and microbatch, one of the positions for packed rows); with expert parallelism the experts'
all-to-alls run inside the stages and the runner reduces their gradients over edp; with a load-balancing loss the
routing statistics ``[2E + 1]`` fp32 flow beside the hidden states (``router_loss.py``).

The first call of each stage checks that its first layer received exactly the activations the probe handed it and
no other hidden-sized tensor (a decoder loop that transforms the hidden states between layers, or carries a second
stream such as a separate residual, would not be cut exactly): ``NotImplementedError`` naming the type otherwise.

Tied embeddings: the first and the last stage both hold the tied weight (the embedding, and the head); the engine
sums its gradient over the two (``pipeline/stage.py`` ``TiedCopies``), as for the native models.

A pipelined model's plain ``forward`` / ``generate`` raise ``RuntimeError`` (each rank holds some layers only):
``model.train_step`` / ``model.eval_step`` run the schedule (set on the instance by ``attach``).
"""
from __future__ import annotations

import functools

import torch

from ..pipeline.adapter import CausalLMPipelineAdapter
from . import router_loss, support
from .install_state import generic_install, update_generic_install
from .pipeline_cut import EmbeddingStandIn, LayerProbe, StageDone, StagePieces, stage_view, viewing


class GenericCausalLMPipelineAdapter(CausalLMPipelineAdapter):
    """A ``transformers`` causal LM cut at its decoder layers (one instance per model: ``for_model``)."""

    batch_keys = ("input_ids", "labels", "attention_mask", "position_ids", "seq_idx", "cu_seqlens", "shift_labels")

    def __init__(self, pieces: StagePieces, layer_costs: list[float], first_extra: float, last_extra: float):
        self.pieces = pieces
        self.layer_paths = (pieces.layers,)
        self.first_modules = {"embedding": pieces.embedding,
                              **{f"first_{i}": path for i, path in enumerate(pieces.first)}}
        self.last_modules = {f"last_{i}": path for i, path in enumerate(pieces.last)}
        self.every_stage_modules = {}
        self.tied_embedding = f"{pieces.embedding}.weight"
        self._costs = (layer_costs, first_extra, last_extra)
        self._views: dict[int, torch.nn.ModuleList] = {}
        self._checked: set[int] = set()

    @classmethod
    def for_model(cls, model) -> "GenericCausalLMPipelineAdapter":
        """Read the pieces and per-layer parameter counts from the uncut (meta) model."""
        pieces = StagePieces.of(model)

        def count(module) -> float:
            return float(sum(p.numel() for p in module.parameters())) if module is not None else 0.0

        costs = [count(layer) for layer in model.get_submodule(pieces.layers)]
        embed = count(model.get_submodule(pieces.embedding))
        last = sum(count(model.get_submodule(path)) for path in pieces.last)
        first = embed + sum(count(model.get_submodule(path)) for path in pieces.first)
        return cls(pieces, costs, first, last + (embed if pieces.tied else 0.0))

    # ------------------------------------------------------------------ structure
    def layer_counts(self, model) -> tuple[int, ...]:
        return (self.pieces.num_layers,)

    def layer_parameter_counts(self, model):
        return self._costs

    def tied_groups(self, model):
        if not self.pieces.tied:
            return []
        return [(self.tied_embedding, f"{self.pieces.head}.weight")]

    # ------------------------------------------------------------------ batches and shapes
    def prepare_batch(self, model, batch):
        """Every stage recomputes positions and masks from the tokens: ``input_ids`` also go to every stage (as the
        keyword ``token_ids``). Packed documents (restarting ``position_ids`` ``[b, s]``, ``seq_idx`` ``[b, s]``, or
        ``cu_seqlens`` ``[n + 1]`` over the flattened batch, turned here into the per-row ``seq_idx`` so that it
        splits into microbatches by rows) go to every stage too, which attends per document
        (``packed_attention``). Under context parallelism the batch holds this rank's chunk(s) and the targets
        shifted on the whole sequence (``shift_labels``, which replace ``labels``); packed documents are read from
        the chunk's restarting ``position_ids`` by the context-parallel mask. Every refusal is raised here, on
        every rank, before the schedule's first send."""
        context = model.parallel_context
        batch = super().prepare_batch(model, batch)  # cp: labels <- shift_labels
        batch["token_ids"] = batch["input_ids"]
        seq = batch["input_ids"].shape[1]
        if generic_install(model).sequence_parallel and seq % context.tp_size:
            raise ValueError(f"sequence_parallel=True needs this rank's sequence length divisible by "
                             f"tensor_parallel_size={context.tp_size}; got {seq}")
        cu_seqlens = batch.pop("cu_seqlens", None)
        if context.cp_size > 1:
            if cu_seqlens is not None or "seq_idx" in batch:
                raise NotImplementedError("a pipelined generic model under context parallelism reads packed "
                                          "documents from restarting position_ids (split like input_ids); pass "
                                          "those instead of cu_seqlens / seq_idx")
            return batch
        if cu_seqlens is not None:
            from ..utils.documents import from_cu_seqlens

            batch["seq_idx"] = from_cu_seqlens(cu_seqlens, *batch["input_ids"].shape).to(batch["input_ids"].device)
        if "position_ids" in batch or "seq_idx" in batch:
            # the refusals of packed_attention (layers that are not attention, flash over several rows) here, on
            # every rank before the schedule's first send, not inside one stage's forward
            _per_document(model, {key: batch.get(key) for key in ("input_ids", "attention_mask")},
                          batch.get("position_ids"), batch.get("seq_idx"))
        return batch

    def use_sequence_parallel(self, model, batch) -> bool:
        """Under sequence parallelism the stages exchange the sequence slices ``[mb, s/tp, h]``: the first stage
        cuts at the model's first layer, the last gathers after its last (``sequence_parallel.install``)."""
        return bool(generic_install(model).sequence_parallel)

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        mb, seq_len = microbatch["input_ids"].shape

        def head_shape():
            head = model.get_output_embeddings()
            weight = head.weight
            rows = weight.to_local().shape[0] if hasattr(weight, "to_local") else weight.shape[0]
            return (mb, seq_len, rows)

        inputs, outputs = self.hidden_state_io(model, layout, stage, microbatch, sequence_parallel, head_shape)
        if not router_loss.pipeline_router_loss(model):
            return inputs, outputs
        statistics = torch.empty(2 * model.num_experts + 1, dtype=torch.float32, device="meta")  # router_loss.py
        return (inputs if stage == 0 else (*inputs, statistics)), (*outputs, statistics)

    # ------------------------------------------------------------------ compute
    def _view(self, model, stage) -> torch.nn.ModuleList:
        index = stage.stage_index
        if index not in self._views:
            self._views[index] = stage_view(model, self.pieces, stage.layout.ranges[index])
        return self._views[index]

    def stage_forward(self, stage, x, statistics=None, attention_mask=None, token_ids=None, position_ids=None,
                      seq_idx=None):
        """``x``: ``input_ids [mb, s]`` on the first stage, else the previous stage's hidden states ``[mb, s, h]``;
        returns hidden states ``[mb, s, h]``, or the logits on the last stage. ``position_ids`` / ``seq_idx``
        ``[mb, s]``: a packed microbatch, whose per-document masks (one per layer type) and positions every stage
        builds as the unpipelined model's pre-hook does (``packed_attention.per_document_inputs``; layers that are not
        attention are refused there, before the forward). With a load-balancing loss (``router_loss.py``)
        ``statistics`` ``[2E + 1]`` come in beside ``x`` (after the first stage) and go out beside the result, this
        stage's layers' routing statistics added."""
        model = stage.owner
        if router_loss.pipeline_router_loss(model):
            layers = [model.get_submodule(self.pieces.layers)[i] for i in stage.layout.ranges[stage.stage_index]]
            with router_loss.StageRouterLogits(model, layers) as routed:
                out = self._run_stage(stage, x, attention_mask, token_ids, position_ids, seq_idx)
            return out, router_loss.stage_statistics(model, routed.logits, attention_mask, statistics)
        return self._run_stage(stage, x, attention_mask, token_ids, position_ids, seq_idx)

    def _run_stage(self, stage, x, attention_mask, token_ids, position_ids, seq_idx, extra=None):
        """One stage's forward; ``extra``: further keyword arguments of the model's forward (an image-text model's
        pixel values and image grids: ``image_text/pipeline.py``)."""
        model = stage.owner
        view = self._view(model, stage)
        first_layer = stage.layout.ranges[stage.stage_index].start
        if not stage.is_first:
            view[first_layer - 1].pending = x
        stand_in = self.__dict__.setdefault("_stand_in", EmbeddingStandIn(self.pieces.hidden_size, self._dtype(model)))
        check = None
        if not stage.is_first and stage.stage_index not in self._checked:
            check = view[first_layer].register_forward_pre_hook(
                functools.partial(_check_first_layer, model, x), with_kwargs=True, prepend=True)
        inputs = dict(input_ids=x if stage.is_first else token_ids, attention_mask=attention_mask, **(extra or {}))
        context = model.parallel_context
        if context.cp_size > 1:  # this rank's chunk(s): global positions, the cp mask (context_parallel.py)
            from .context_parallel import KEYWORD, chunk_inputs

            inputs = chunk_inputs(context, {**inputs, "position_ids": position_ids}, inputs["input_ids"])
            calls = generic_install(model).context_parallel_calls
            if calls is not None:  # the load-time check counts the attention calls (context_parallel.install)
                calls.append(inputs[KEYWORD])
        elif position_ids is not None or seq_idx is not None:
            inputs = _per_document(model, inputs, position_ids, seq_idx)
        try:
            with viewing(model, self.pieces, view, stage.is_first, stand_in):
                output = type(model).forward(model, **{**inputs, "use_cache": False}, return_dict=True)
        except StageDone as done:
            return done.hidden
        finally:
            if check is not None:
                check.remove()
                self._checked.add(stage.stage_index)
            if not stage.is_first:
                view[first_layer - 1].pending = None
        if not stage.is_last:
            raise RuntimeError(f"{type(model).__name__}: pipeline stage {stage.stage_index} ran past its last layer")
        return output.logits

    @staticmethod
    def _dtype(model) -> torch.dtype:
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

    def microbatch_loss(self, model, outputs, labels, num_items_in_batch, num_microbatches: int):
        """The token loss, plus ``router_aux_loss_coef * aux / M`` from the carried statistics when the model adds a
        load-balancing loss (``router_loss.py``)."""
        if not router_loss.pipeline_router_loss(model):
            return self.loss(model, outputs, labels, num_items_in_batch)
        logits, statistics = outputs
        loss = self.loss(model, logits, labels, num_items_in_batch)
        return loss + router_loss.microbatch_router_loss(model, statistics, num_microbatches).to(loss.dtype)

    def loss(self, model, logits, labels, num_items_in_batch):
        """``transformers``' causal-LM loss (labels shifted left) on the logits, or on this rank's vocabulary slice
        of them (``vocab_parallel_loss.py``): summed token losses / ``num_items_in_batch``. Under context
        parallelism ``labels`` are the chunk's targets already shifted on the whole sequence (``prepare_batch``):
        the result is the chunk's share (``runner._LossFn`` sums it over cp)."""
        shifted = labels if model.parallel_context.cp_size > 1 else None
        if generic_install(model).vocab_parallel_loss:
            return model.loss_function(logits, labels, num_items_in_batch=num_items_in_batch, shift_labels=shifted)
        from ..parallel_layers.cross_entropy import causal_lm_loss

        return causal_lm_loss(logits, labels, group=None, vocab_start=0, num_items_in_batch=num_items_in_batch,
                              shift_labels=shifted)


def _per_document(model, inputs: dict, position_ids, seq_idx) -> dict:
    """The forward's keyword arguments for a packed microbatch: what the unpipelined model's packed-attention
    pre-hook passes (per-document masks, positions restarting per document). The stage calls the class's forward
    directly (the model's own pre-hooks refuse a pipelined forward), so it applies the same function here."""
    from .packed_attention import per_document_inputs

    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if seq_idx is not None:
        inputs["seq_idx"] = seq_idx
    return per_document_inputs(model, inputs)


def _check_first_layer(model, received, module, args, kwargs):
    """Pre-hook of a stage's first layer, on the stage's first call: it must get the received activations and no
    other hidden-sized tensor."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    others = [value for value in (*args[1:], *kwargs.values())
              if torch.is_tensor(value) and value.is_floating_point() and value.shape == received.shape]
    if hidden is not received or others:
        why = ("transforms the hidden states between its layers" if hidden is not received else
               "gives its layers a second hidden-sized tensor (a stream carried across layers)")
        raise NotImplementedError(f"{type(model).__name__} cannot be pipelined on the generic path: its decoder loop "
                                  f"{why}, so a stage cannot start from the previous stage's activations alone")


def local_stage_outputs(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of this rank's stages run alone on ``input_ids`` ``[b, s]`` (a stage after the first starts from zeros
    ``[b, s, h]`` instead of received activations): its outputs, the last stage's logits whole (gathered over tp).
    What the load-time checks of a tensor-parallel plan (``dummy_forward.py``) run on a pipelined model; no
    point-to-point communication, the layers' own tp collectives only."""
    from types import SimpleNamespace

    adapter, layout = generic_install(model).pipeline_adapter, model.pipeline_layout
    outputs = []
    for index in layout.local_stages:
        stage = SimpleNamespace(owner=model, stage_index=index, layout=layout, is_first=index == 0,
                                is_last=index == layout.num_stages - 1)
        x = input_ids if stage.is_first else _received(model, input_ids, adapter)
        out = adapter.stage_forward(stage, x, token_ids=input_ids)
        if isinstance(out, tuple):  # (activations, routing statistics): the statistics are not the plan's concern
            out = out[0]
        if stage.is_last and generic_install(model).vocab_parallel_loss:
            out = _gather_vocabulary(model, out)
        outputs.append(out)
    return tuple(outputs)


def _received(model, input_ids: torch.Tensor, adapter) -> torch.Tensor:
    """What a later stage's dummy run starts from: zeros ``[b, s, h]``; under sequence parallelism this rank's
    slice ``[b, s/tp, h]`` of them, cut as the first layer's hook cuts (``Replicate -> Shard(1)``, requiring grad), so
    the graph rule of ``partial_gradients.py`` sees the stage's activations as split over tp, as they are."""
    zeros = torch.zeros((*input_ids.shape, adapter.pieces.hidden_size), dtype=adapter._dtype(model),
                        device=input_ids.device)
    if not adapter.use_sequence_parallel(model, {}):
        return zeros
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = DTensor.from_local(zeros.requires_grad_(torch.is_grad_enabled()), model.parallel_context.mesh["tp"],
                               [Replicate()], run_check=False)
    return whole.redistribute(placements=[Shard(1)]).to_local()


def _gather_vocabulary(model, logits: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    vocab = model.get_output_embeddings().out_features
    shape = (*logits.shape[:-1], vocab)
    split = DTensor.from_local(logits, model.parallel_context.mesh["tp"], [Shard(logits.dim() - 1)], run_check=False,
                               shape=shape, stride=torch.empty(shape, device="meta").stride())
    return split.redistribute(placements=[Replicate()]).to_local()


def _refuse_forward(model, args, kwargs):
    raise RuntimeError(f"{type(model).__name__} is split into pipeline stages (pipeline_parallel_size="
                       f"{model.parallel_context.pp_size}): each rank holds only its stages' layers, so forward() and "
                       f"generate() cannot run here. Train with model.train_step(batch), evaluate with "
                       f"model.eval_step(batch); for inference, model.save_pretrained(folder) (every rank) and load "
                       f"it without pipelining.")


def _runner(model):
    from ..pipeline.runner import pipeline_runner

    return pipeline_runner(model)


def _train_step(model, batch, *, labels=None, attention_mask=None, optimizer=None, scaler=None, loss_fn=None,
                loss_inputs=None):
    return _runner(model).train_step(batch, labels=labels, attention_mask=attention_mask, optimizer=optimizer,
                                     scaler=scaler, loss_fn=loss_fn, loss_inputs=loss_inputs)


def _eval_step(model, batch, *, labels=None, attention_mask=None):
    return _runner(model).eval_step(batch, labels=labels, attention_mask=attention_mask)


def _save_pretrained(model, save_directory, *, max_shard_size="5GB", **kwargs):
    """``model.save_pretrained`` of a pipelined generic model: the distributed Hub export every rank joins
    (``om.training.save_pretrained``), not ``transformers``' own, which would write this rank's stages only."""
    unsupported = sorted(key for key, value in kwargs.items()
                         if key not in ("is_main_process", "safe_serialization") and value not in (None, False))
    if unsupported:
        raise ValueError(f"save_pretrained of a pipelined {type(model).__name__} writes the whole model from every "
                         f"rank (om.training.save_pretrained); options {unsupported} are not supported there")
    from ..training.export import save_pretrained

    return save_pretrained(model, save_directory, max_shard_size=max_shard_size)


def attach(model) -> None:
    """Give a pipelined generic model the native models' step API on the instance (``train_step``, ``eval_step``;
    the runner is built on first use, collectively), route its ``save_pretrained`` to the every-rank Hub export and
    refuse its plain forward / ``generate``."""
    router_loss.check_pipeline(model)  # a load-balancing loss the stages can carry, or NotImplementedError
    model.__dict__["save_pretrained"] = functools.partial(_save_pretrained, model)
    model.__dict__["train_step"] = functools.partial(_train_step, model)
    model.__dict__["eval_step"] = functools.partial(_eval_step, model)
    model.__dict__["_pipeline_runner"] = functools.partial(_runner, model)
    model.register_forward_pre_hook(_refuse_forward, with_kwargs=True)


__all__ = ["GenericCausalLMPipelineAdapter", "LayerProbe", "attach"]


def cut(model, context, *, loaded: bool) -> None:
    """Cut ``model`` (``transformers``' class; on the meta device unless ``loaded``) to this rank's stages
    (``pipeline_cut.cut_stages``); sets ``model.pipeline_layout``. No collective."""
    from ..pipeline.stage import build_layout
    from .pipeline_cut import cut_stages
    from .protocol import GenericProtocol

    model.parallel_context, model.oslo_protocol = context, GenericProtocol()  # as _attach sets them later
    adapter_class = GenericCausalLMPipelineAdapter
    if support.is_image_text(model.config, type(model)):  # the vision side and image batches on the first stage
        from ..image_text.pipeline import ImageTextPipelineAdapter as adapter_class
    adapter = update_generic_install(model, pipeline_adapter=adapter_class.for_model(model)).pipeline_adapter
    layout = build_layout(model, context)
    cut_stages(model, adapter.pieces, layout, loaded=loaded)
    model.pipeline_layout = layout


def finish(model) -> None:
    """After the load: the tied last stage's embedding becomes the stand-in (``pipeline_cut.finish_cut``)."""
    from .pipeline_cut import finish_cut

    finish_cut(model, generic_install(model).pipeline_adapter.pieces, model.pipeline_layout)
