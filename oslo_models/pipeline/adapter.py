"""What one model family tells the pipeline engine: the pieces of its module tree and how a stage runs them.

A model class opts into pipeline parallelism by naming a ``PipelineAdapter`` subclass in its
``pipeline_adapter`` class attribute (derived for the stack families: ``models/common/pipeline/pipeline_stack.py``; ``models/common/pipeline/pipeline_encoder.py``, ...).
The engine (``stage.py``, ``checkpoint.py``, ``runner.py``) reads nothing model-specific except through it.

Vocabulary:

- *layers*: the repeated blocks, in one or more containers run one after the other (``layer_paths``; T5 has
  ``encoder.block`` then ``decoder.block``). Stages cut the concatenation of the containers: *flat* layer ``i``
  is ``layer_ids(model)[i] == (container_path, index_in_container)``.
- *stage modules*: everything else a stage runs (embeddings, final norms, heads), as ``attribute -> module
  path``; ``stage_modules`` says which ones stage ``s`` needs. Modules no local stage needs are dropped on meta.
- *tied groups*: parameter names that are one tensor in ``transformers`` (input and output embedding). Stages on
  different ranks hold copies; the engine loads every copy from one checkpoint tensor and sums their gradients.
- *microbatch tensors*: the batch, after ``prepare_batch``, is a dict of ``[b, ...]`` tensors. ``first_inputs``
  go positionally to the first stage; ``labels`` go to the loss on the last stage; every other tensor is passed as
  a keyword to every stage (masks, decoder inputs). Between stages flow the tensors ``stage_io`` declares.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch


class PipelineAdapter:
    """Base class; families override the attributes and the methods that raise ``NotImplementedError``."""

    layer_paths: tuple[str, ...] = ()
    #: batch keys a pipelined step accepts (anything else is a ``ValueError``)
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "attention_mask")
    #: batch keys fed positionally to the first stage
    first_inputs: tuple[str, ...] = ("input_ids",)
    #: dimensions of the batch's ``input_ids`` (3: ``[batch, choices, seq]``, flattened by ``prepare_batch``)
    input_ids_dims: int = 2
    #: whether stages run under the 2D / 2.5D / 3D tensor-parallel modes (their ``stage_io`` gives grid blocks)
    grid_modes: bool = False

    # ------------------------------------------------------------------ structure
    def layer_counts(self, model) -> tuple[int, ...]:
        """Layers in each container of ``layer_paths``, from the config (the model may already be cut)."""
        raise NotImplementedError

    def layer_ids(self, model) -> list[tuple[str, int]]:
        """Flat layer index -> ``(container path, index in that container)``."""
        return [(path, index) for path, count in zip(self.layer_paths, self.layer_counts(model))
                for index in range(count)]

    def num_layers(self, model) -> int:
        return sum(self.layer_counts(model))

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Per flat layer parameter count, plus the extra parameters of the first and of the last stage."""
        raise NotImplementedError

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        """Non-layer modules stage ``stage`` runs: ``{attribute on the StageModule: module path in model}``."""
        raise NotImplementedError

    def optional_modules(self, model, layout) -> set[str]:
        """Every non-layer module path some stage runs (a rank drops those none of its stages needs)."""
        return {path for stage in range(layout.num_stages)
                for path in self.stage_modules(model, layout, stage).values()}

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        """Groups of parameter names that are one tensor for this config (first name: the one loaded/saved)."""
        return []

    # ------------------------------------------------------------------ batches and shapes
    def prepare_batch(self, model, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Complete the batch before it is split (e.g. T5 derives ``decoder_input_ids`` from ``labels``)."""
        return batch

    def use_sequence_parallel(self, model, batch: Mapping[str, torch.Tensor]) -> bool:
        raise NotImplementedError

    def stage_io(self, model, layout, stage: int, microbatch: Mapping[str, torch.Tensor], sequence_parallel: bool
                 ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Meta tensors of the stage's positional inputs and of its outputs for one microbatch.

        ``microbatch``: meta tensors of one microbatch of the prepared batch. The runner marks floating-point
        tensors ``requires_grad`` in training (gradients flow back through them).
        """
        raise NotImplementedError

    def hidden_state_io(self, model, layout, stage: int, microbatch: Mapping[str, torch.Tensor],
                        sequence_parallel: bool, head_shape: Callable[[], tuple[int, ...]] | None):
        """``stage_io`` of a decoder- or encoder-only family: ``input_ids [mb, s]`` into the first stage, hidden
        states ``[mb, s(/tp), h]`` between stages (split by sequence under SP; ``[mb/(dq), s, h/q]`` under the grid
        modes), a tensor of ``head_shape()`` out of the last (called there only: the head exists on the last stage
        only; its batch dim is replaced by the local one). ``head_shape=None``: the last stage sends out its final
        hidden states ``[mb, s, h]`` (the tiled loss runs the head, ``CausalLMPipelineAdapter.tiles_loss``)."""
        mb, seq_len = microbatch["input_ids"].shape
        dtype = next(model.parameters()).dtype
        context = model.parallel_context
        tp = context.tp_size if sequence_parallel else 1
        local_mb, width = mb, model.config.hidden_size
        if context.is_grid:  # 2D/2.5D/3D: this rank's block of batch and hidden
            from ..parallel_layers.grid_boundary import local_activation_shape

            local_mb, width = local_activation_shape(context, mb, width)
        hidden = torch.empty(local_mb, seq_len // tp, width, dtype=dtype, device="meta")
        inputs = (microbatch["input_ids"],) if stage == 0 else (hidden,)
        if stage < layout.num_stages - 1:
            return inputs, (hidden,)
        if head_shape is None:  # the final hidden states, whole sequence (the last stage gathers SP's split)
            return inputs, (torch.empty(local_mb, seq_len, width, dtype=dtype, device="meta"),)
        head = head_shape()  # batch-major; the grid modes' heads keep this rank's batch block too
        return inputs, (torch.empty((local_mb, *head[1:]), dtype=dtype, device="meta"),)

    def whole_backward_stages(self, model, layout) -> set[int]:
        """Stages whose backward computes input and weight gradients in one pass, also under zero-bubble schedules.

        torch's split backward reaches a stage's weights only through the autograd graph of the stage's inputs: a
        weight that feeds an output by a path no input joins (T5's decoder position bias, computed from weights
        alone and sent on) would get no gradient from that output. Such stages give up the split, not correctness.
        """
        return set()

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, *inputs, **kwargs):
        """Run stage ``stage`` (a ``StageModule``) on its inputs; return its outputs (a tensor or a tuple)."""
        raise NotImplementedError

    def loss(self, model, outputs, labels, num_items_in_batch):
        """The loss of one microbatch from the last stage's outputs: its summed token losses / ``num_items``."""
        raise NotImplementedError

    def microbatch_loss(self, model, outputs, labels, num_items_in_batch, num_microbatches: int):
        """What the schedule's ``loss_fn`` returns for one of ``num_microbatches`` microbatches: ``loss`` here;
        families with a per-microbatch term (the MoE load-balancing loss) weight it by ``1/num_microbatches``."""
        return self.loss(model, outputs, labels, num_items_in_batch)

    def num_loss_items(self, labels: torch.Tensor) -> int:
        """Tokens the loss averages over in the whole (local) batch."""
        return int((labels != -100).sum())

    def loss_items(self, model, labels: torch.Tensor) -> int:
        """What this replica's loss averages over in its (local) batch at cp=1: ``num_loss_items``, or a family's
        rule that reads the config. The runner sums it over the data ranks (the global batch's divisor)."""
        return self.num_loss_items(labels)


class CausalLMPipelineAdapter(PipelineAdapter):
    """A decoder-only causal LM: the embeddings on the first stage (``first_modules``), parameter-free helpers such
    as a rotary embedding on every stage (``every_stage_modules``), the final norm and ``lm_head`` on the last
    (``last_modules``), the head tied to ``tied_embedding`` when ``config.tie_word_embeddings``. The last stage's
    output is the vocab-split logits ``[mb, s, V_padded/tp]`` and the loss is ``transformers``' causal-LM loss
    (labels shifted left) on them.

    Tiled loss (``ParallelConfig(tiled_loss=True)``, adapters with ``tiled_loss_head``; :meth:`tiles_loss`): the last
    stage's forward stops at the final hidden states ``[mb, s, h]`` and the schedule's loss function runs
    ``model.lm_head`` and the cross-entropy fused in row chunks (``head_loss``: no ``[mb, s, V/tp]`` logits in
    forward nor backward). Collectives as without it (vocab-parallel head: forward all-reduce MAX and SUM per row
    chunk, backward one all-reduce SUM of the hidden-state gradient over tp; under cp the runner's sum over cp)."""

    first_modules: dict[str, str] = {}
    every_stage_modules: dict[str, str] = {}
    last_modules: dict[str, str] = {}
    tied_embedding: str = ""  # the input embedding's weight, e.g. "transformer.wte.weight"
    #: whether the last stage can hand its final hidden states to a tiled loss (its ``stage_forward`` reads
    #: :meth:`tiles_loss`); the generic path's stages always return logits
    tiled_loss_head: bool = False

    def tiles_loss(self, model) -> bool:
        """Whether the last stage outputs hidden states and the loss runs the head in chunks: the adapter supports
        it and ``ParallelConfig.tiled_loss`` is on (in training and in ``eval_step`` alike: a pipeline step returns
        only the loss)."""
        return self.tiled_loss_head and bool(model.parallel_context.config.tiled_loss)

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = {**(self.first_modules if stage == 0 else {}), **self.every_stage_modules}
        if stage == layout.num_stages - 1:
            modules.update(self.last_modules)
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        return set(self.first_modules.values()) | set(self.last_modules.values())

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        if getattr(model.config, "tie_word_embeddings", False):
            return [(self.tied_embedding, "lm_head.weight")]
        return []

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        mb, seq_len = microbatch["input_ids"].shape
        return self.hidden_state_io(model, layout, stage, microbatch, sequence_parallel,
                                    None if self.tiles_loss(model) else
                                    lambda: (mb, seq_len, model.lm_head.out_features))

    def prepare_batch(self, model, batch):
        """Under context parallelism the targets must come shifted on the whole sequence (``shift_labels``, as
        ``ContextParallelSplitter`` makes them): they replace ``labels`` (a chunk cannot shift its own)."""
        if model.parallel_context.cp_size == 1:
            batch.pop("shift_labels", None)
            return batch
        if "shift_labels" not in batch:
            raise ValueError("a pipelined causal LM under context parallelism needs shift_labels in the batch (the "
                             "targets shifted on the full sequence before the split: ContextParallelSplitter("
                             "shift_labels=True) makes them)")
        batch["labels"] = batch.pop("shift_labels")
        return batch

    def loss(self, model, local_logits, labels, num_items_in_batch):
        """``transformers``' causal-LM loss; under context parallelism ``labels`` are already shifted (see
        ``prepare_batch``) and the result is this chunk's share (``runner._LossFn`` sums it over cp). With
        :meth:`tiles_loss` ``local_logits`` are the final hidden states ``[mb, s, h]`` and the head runs here, fused
        with the cross-entropy in row chunks."""
        from ..parallel_layers.cross_entropy import causal_lm_loss

        head = model.lm_head
        shifted = labels if model.parallel_context.cp_size > 1 else None
        if self.tiles_loss(model):
            from ..models.common.loss.lm_loss import head_loss_and_logits

            cap = model.final_logit_softcap() if hasattr(model, "final_logit_softcap") else None
            loss, _ = head_loss_and_logits(head, local_logits, labels, causal=True, skip_logits=True,
                                           fused=model.parallel_context.config.fused_ops,
                                           num_items_in_batch=num_items_in_batch, shift_labels=shifted,
                                           logit_softcap=cap)
            return loss
        return causal_lm_loss(local_logits, labels, group=getattr(head, "group", None),
                              vocab_start=getattr(head, "vocab_start_index", 0), num_items_in_batch=num_items_in_batch,
                              shift_labels=shifted)

    def num_loss_items(self, labels: torch.Tensor) -> int:
        """Tokens the causal loss averages over: labels shifted left, ``-100`` excluded."""
        return int((labels[..., 1:] != -100).sum())


def _adapter_class(model_class: type) -> type:
    adapter_class = getattr(model_class, "pipeline_adapter", None)
    if adapter_class is None:
        raise NotImplementedError(f"pipeline_parallel_size > 1 is not implemented for {model_class.__name__} (it "
                                  f"has no pipeline_adapter)")
    return adapter_class


def check_pipeline_support(model_class: type, parallel) -> None:
    """Before anything is built: ``NotImplementedError`` when ``model_class`` cannot be cut into
    ``parallel.pipeline_parallel_size`` stages (no pipeline adapter, or a grid tensor-parallel mode its adapter
    does not run); nothing at pp 1."""
    if parallel.pipeline_parallel_size == 1:
        return
    mode, adapter_class = parallel.tensor_parallel_mode, _adapter_class(model_class)
    if mode != "1d" and not adapter_class.grid_modes:
        raise NotImplementedError(f"pipeline_parallel_size > 1 with tensor_parallel_mode={mode!r} is not "
                                  f"implemented for {model_class.__name__}; use tensor_parallel_mode='1d' or no "
                                  "pipeline parallelism for it")


def adapter_for(model) -> PipelineAdapter:
    """The pipeline adapter of ``model``, as the model protocol answers it (``utils/model_protocol.py``: a native
    family's ``pipeline_adapter`` class, the generic path's adapter cut from ``transformers``' module tree);
    ``NotImplementedError`` naming the class when there is none or when it does not run the tensor-parallel mode."""
    from ..utils.model_protocol import protocol_of

    adapter = protocol_of(model).pipeline_adapter(model)
    mode = model.parallel_context.config.tensor_parallel_mode
    if model.parallel_context.pp_size > 1 and mode != "1d" and not adapter.grid_modes:
        raise NotImplementedError(f"pipeline_parallel_size > 1 with tensor_parallel_mode={mode!r} is not "
                                  f"implemented for {type(model).__name__}; use tensor_parallel_mode='1d' or no "
                                  "pipeline parallelism for it")
    return adapter
