"""Pipeline stages cut out of an unmodified model: each rank keeps only the modules of its own stages.

The model class is not rewritten as ``nn.Sequential``. A small per-family ``PipelineAdapter`` names the pieces
of the existing module tree (the layer container, the modules that run before the layers and after them) and
says how one stage runs them. ``keep_stage_modules`` then, while the model is still on the meta device:

- replaces the layer container (``transformer.h``) by ``StageLayers`` holding this rank's layers under their
  *global* indices, so parameter names stay the Hub names (``transformer.h.5.attn.c_attn.weight``) and loading
  and saving by name keep working;
- drops (sets to ``None``) the embeddings on ranks without the first stage and the final norm and head on
  ranks without the last stage.

Tied input/output embeddings: the first stage holds ``wte`` and the last stage holds ``lm_head``, two copies of
one tensor on different ranks. Both are loaded from the same checkpoint tensor; after each backward their
gradients are summed over the two ranks (``tied_embedding_group``), so with the same optimizer they stay equal
and equal the single-process tied weight.

A ``StageModule`` is the ``nn.Module`` handed to ``torch.distributed.pipelining.PipelineStage`` for one stage: it
registers only that stage's modules (shared with the model, not copied), so the stage's ``parameters()`` — which
torch uses for the zero-bubble weight-gradient pass — are exactly the stage's own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers.masking_utils import create_causal_mask

from ..parallel_layers.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from .partition import partition_layers, stage_to_rank, stages_of_rank


@dataclass(frozen=True)
class PipelineLayout:
    """Where every stage lives. ``ranges[s]``: layers of stage ``s``; ``local_stages``: this rank's stages."""

    pp_size: int
    virtual_size: int
    ranges: tuple[range, ...]
    local_stages: tuple[int, ...]

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def has_first(self) -> bool:
        return 0 in self.local_stages

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.local_stages

    @property
    def last_rank(self) -> int:
        return stage_to_rank(self.num_stages - 1, self.pp_size)

    def local_layers(self) -> list[int]:
        return [layer for stage in self.local_stages for layer in self.ranges[stage]]


class StageLayers(nn.Module):
    """The layers this rank owns, registered under their global index; iterates in index order."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index in sorted(layers):
            self.add_module(str(index), layers[index])

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


# ---------------------------------------------------------------------------------------------- adapters
class GPT2LMPipelineAdapter:
    """GPT-2 LM: first stage ``wte``+``wpe``+``drop``; layers ``transformer.h``; last stage ``ln_f``+``lm_head``.

    Stage forward (activations ``[mb, s, h]``; ``[mb, s/tp, h]`` between stages under sequence parallelism, each
    TP rank sending its own slice to the same TP rank of the next stage):
    first stage: ``input_ids [mb, s]`` -> embeddings (vocab-parallel all-reduce over TP) -> SP scatter -> dropout;
    every stage: its blocks; last stage: ``ln_f`` -> SP all-gather -> ``lm_head`` -> local logits
    ``[mb, s, V_padded/tp]`` (the loss runs on the split vocabulary; no logits gather).
    """

    layers_path = "transformer.h"
    first_modules = ("transformer.wte", "transformer.wpe")
    last_modules = ("transformer.ln_f", "lm_head")
    tied = ("transformer.wte.weight", "lm_head.weight")  # (input embedding, output embedding)

    def num_layers(self, model) -> int:
        return model.config.num_hidden_layers

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Per-layer, first-stage and last-stage parameter counts of the full model (from the config)."""
        config = model.config
        h, inner = config.hidden_size, config.n_inner or 4 * config.hidden_size
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * inner + inner) + (inner * h + h)
        embeddings = config.vocab_size * h + config.max_position_embeddings * h
        return [float(layer)] * config.num_hidden_layers, float(embeddings), float(config.vocab_size * h + 2 * h)

    def stage_forward(self, stage: "StageModule", x, attention_mask=None, position_ids=None):
        config, context = stage.model_config, stage.parallel_context
        sp = stage.sequence_parallel
        if stage.is_first:
            seq_len = x.shape[-1]
            if position_ids is None:
                position_ids = torch.arange(seq_len, device=x.device).unsqueeze(0)
            hidden = stage.wte(x) + stage.wpe(position_ids)
            if sp:
                hidden = scatter_to_sequence_parallel_region(hidden, context.tp_group)
            hidden = stage.drop(hidden, sequence_parallel=sp)
        else:
            hidden = x
            seq_len = hidden.shape[1] * (context.tp_size if sp else 1)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
        # The mask only reads the batch size, sequence length, dtype and device of inputs_embeds: a zero-size
        # expanded view stands in for the full [mb, s, h] activations that only the first stage ever has.
        shape_only = hidden.new_zeros(()).expand(hidden.shape[0], seq_len, hidden.shape[-1])
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(hidden.shape[0], -1)
        mask = create_causal_mask(config=config, inputs_embeds=shape_only, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        for block in stage.layers:
            hidden = block(hidden, mask, None, sequence_parallel=sp, position_ids=position_ids)
        if not stage.is_last:
            return hidden
        hidden = stage.ln_f(hidden, sequence_parallel=sp)
        if sp:
            hidden = gather_from_sequence_parallel_region(hidden, context.tp_group, grad_is_partial=False)
        return stage.lm_head(hidden)  # [mb, s, V_padded/tp]

    def activation_shape(self, model, microbatch: int, seq_len: int, sequence_parallel: bool) -> tuple[int, ...]:
        tp = model.parallel_context.tp_size if sequence_parallel else 1
        return (microbatch, seq_len // tp, model.config.hidden_size)

    def output_shape(self, model, microbatch: int, seq_len: int) -> tuple[int, ...]:
        return (microbatch, seq_len, model.lm_head.weight.shape[0])

    def use_sequence_parallel(self, model, seq_len: int) -> bool:
        return model.transformer._use_sequence_parallel(seq_len)

    def loss(self, model, local_logits, labels, num_items_in_batch):
        from ..parallel_layers.cross_entropy import causal_lm_loss

        head = model.lm_head
        return causal_lm_loss(local_logits, labels, group=getattr(head, "group", None),
                              vocab_start=getattr(head, "vocab_start_index", 0), num_items_in_batch=num_items_in_batch)

    def num_loss_items(self, labels: torch.Tensor, ignore_index: int = -100) -> int:
        """Tokens the causal loss averages over: labels shifted left, ``ignore_index`` excluded."""
        return int((labels[..., 1:] != ignore_index).sum())


def adapter_for(model) -> GPT2LMPipelineAdapter:
    """The pipeline adapter of ``model``'s class; ``NotImplementedError`` naming the class when there is none."""
    if type(model).__name__ == "GPT2LMHeadModel":
        return GPT2LMPipelineAdapter()
    raise NotImplementedError(f"pipeline_parallel_size > 1 is implemented for GPT2LMHeadModel only, not for "
                              f"{type(model).__name__} yet")


# ---------------------------------------------------------------------------------------------- pruning
def build_layout(model, context) -> PipelineLayout:
    """Partition ``model``'s layers over ``context``'s pipeline ranks per ``ParallelConfig``."""
    adapter = adapter_for(model)
    config = context.config
    num_stages = context.pp_size * config.virtual_pipeline_size
    costs, first, last = adapter.layer_parameter_counts(model)
    ranges = partition_layers(adapter.num_layers(model), num_stages, config.pipeline_partition, layer_costs=costs,
                              first_extra=first, last_extra=last)
    return PipelineLayout(context.pp_size, config.virtual_pipeline_size, tuple(ranges),
                          tuple(stages_of_rank(context.pp_rank, context.pp_size, config.virtual_pipeline_size)))


def keep_stage_modules(model, context) -> PipelineLayout:
    """Drop every module this rank's stages do not run (call on the meta device, before allocation)."""
    adapter = adapter_for(model)
    layout = build_layout(model, context)
    parent_name, _, leaf = adapter.layers_path.rpartition(".")
    parent = model.get_submodule(parent_name)
    all_layers = getattr(parent, leaf)
    setattr(parent, leaf, StageLayers({i: all_layers[i] for i in layout.local_layers()}))
    dropped = (() if layout.has_first else adapter.first_modules) + (() if layout.has_last else adapter.last_modules)
    for name in dropped:
        owner_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner_name) if owner_name else model, attr, None)
    model.pipeline_layout = layout
    return layout


class StageModule(nn.Module):
    """One pipeline stage over shared modules of ``model``: registers only this stage's parameters.

    ``forward(x, attention_mask=None, position_ids=None)``: ``x`` is ``input_ids [mb, s]`` on the first stage and
    the previous stage's activations otherwise; returns activations, or local logits on the last stage.
    """

    def __init__(self, model, stage: int, layout: PipelineLayout, *, sequence_parallel: bool):
        super().__init__()
        self.adapter = adapter_for(model)
        self.stage_index = stage
        self.is_first, self.is_last = stage == 0, stage == layout.num_stages - 1
        self.sequence_parallel = sequence_parallel
        # Plain attributes (not submodules): the config and context are shared, not parameters of the stage.
        object.__setattr__(self, "model_config", model.config)
        object.__setattr__(self, "parallel_context", model.parallel_context)
        all_layers = model.get_submodule(self.adapter.layers_path)
        self.layers = nn.ModuleList([all_layers[i] for i in layout.ranges[stage]])
        if self.is_first:
            self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        if self.is_last:
            self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x, attention_mask=None, position_ids=None):
        return self.adapter.stage_forward(self, x, attention_mask=attention_mask, position_ids=position_ids)


# ---------------------------------------------------------------------------------------------- tied weights
def tied_embedding_group(context, layout: PipelineLayout):
    """Process group of the ranks holding the first and last stage for this rank's (dp, tp) coordinate.

    Collective: every rank calls ``new_group`` for every (dp, tp) pair, in the same order (torch requires it).
    Returns ``None`` on ranks outside their pair, or when first and last stage share a rank.
    """
    first_rank, last_rank = 0, layout.last_rank
    if first_rank == last_rank:
        return None
    mesh = context.mesh.mesh  # [pp, dp, tp] global ranks
    mine = None
    for dp in range(mesh.shape[1]):
        for tp in range(mesh.shape[2]):
            ranks = [int(mesh[first_rank, dp, tp]), int(mesh[last_rank, dp, tp])]
            group = dist.new_group(ranks)
            if context.rank in ranks:
                mine = group
    return mine


def tied_parameter(model, layout: PipelineLayout):
    """This rank's copy of the tied embedding (``wte`` on the first stage, ``lm_head`` on the last), or None."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    adapter = adapter_for(model)
    if layout.has_first:
        return model.get_parameter(adapter.tied[0])
    if layout.has_last:
        return model.get_parameter(adapter.tied[1])
    return None
