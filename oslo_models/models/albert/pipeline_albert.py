"""ALBERT's heads as pipeline stages: the encoder stages every encoder head shares
(``common/pipeline/pipeline_encoder.py``: the base model's own phases on each stage's layers, one hidden-state tensor
``[mb, s(/tp), h]`` between stages, the head class's task rule on the last) over ALBERT's depth sharing.

The pipeline cuts the ``num_hidden_layers`` layers (the depth), not the ``num_hidden_groups`` modules of
``albert.encoder.albert_layer_groups``: flat layer ``i`` is the group ``transformers`` runs there
(``int(i / (L / G))``), so ``layer_ids`` maps several flat layers to one container index. A stage keeps each group
its layers run once (under its Hub name: ``albert.encoder.albert_layer_groups.<g>...``) and runs it once per layer.

A group run by layers on two stages (the cut falls inside the group's layers: 4 layers over 1 group, or
``pipeline_partition=(1, 3)`` over 2 groups) is held by both pipeline ranks: each of its parameters is a *tied
group* of one name (``tied_groups``), like a tied input / output embedding. Both copies load the one checkpoint
tensor; after each backward ``TiedCopies`` all-reduces (sums) their gradients over the pipeline ranks holding them
(one group per set of ranks, on each (dp, tp) coordinate), so each copy's gradient is the single-process gradient
summed over every use, and with the same optimizer the copies stay equal; the gradient norm counts the copy of the
lowest rank only (``tied_duplicates``), saving writes the key once (stages' state dicts merge by name).

The first stage also holds ``encoder.embedding_hidden_mapping_in`` (``embedding_extras``: ``[b, s, e] -> [b, s, h]``),
the last the head (the MLM head ``predictions``: its vocab-parallel ``decoder`` a copy of the word embeddings,
tied too).
"""
from __future__ import annotations

import torch


def group_of_layer(config, layer: int) -> int:
    """The layer group ``transformers``' ``AlbertTransformer`` runs at depth ``layer``."""
    return int(layer / (config.num_hidden_layers / config.num_hidden_groups))


def check_sharded_pipeline(model_class: type, config, parallel) -> None:
    """``ValueError`` when ``parallel`` asks for ZeRO-2/3 with pipeline stages and some pipeline rank would run one
    shared layer group at several depths (``num_hidden_groups=1``, every released ALBERT, does so whenever a stage
    holds two layers); from the config alone, before any process group, so every rank decides alike.

    Why: ZeRO-2/3 under pipeline parallelism makes each layer of a stage one FSDP2 unit (``training/zero.py``); a
    group run at several depths would be one unit gathered and resharded per use, its gradient reduce-scattered
    before its other uses added theirs. Layouts where each rank runs each group once (as many stages as layers, or a
    cut at every group boundary with one layer per group) pass."""
    if parallel.pipeline_parallel_size == 1 or parallel.zero_stage < 2:
        return
    adapter_class = getattr(model_class, "pipeline_adapter", None)
    if adapter_class is None:  # no stages: refused by the pipeline's own check
        return
    from types import SimpleNamespace

    from ...pipeline.partition import partition_layers, stages_of_rank

    pp, virtual = parallel.pipeline_parallel_size, parallel.virtual_pipeline_size
    # the partition the model will use: per-layer costs from the meta-built head class (only ``config`` is read)
    costs, first, last = adapter_class().layer_parameter_counts(SimpleNamespace(config=config))
    ranges = partition_layers(config.num_hidden_layers, pp * virtual, parallel.pipeline_partition,
                              layer_costs=costs, first_extra=first, last_extra=last)
    for rank in range(pp):
        groups = [group_of_layer(config, layer) for stage in stages_of_rank(rank, pp, virtual)
                  for layer in ranges[stage]]
        repeated = sorted({group for group in groups if groups.count(group) > 1})
        if repeated:
            raise ValueError(
                f"zero_stage={parallel.zero_stage} with pipeline_parallel_size={pp} is not implemented for "
                f"{model_class.__name__} at this layout: pipeline rank {rank} runs the shared layer group(s) "
                f"{repeated} at several depths, and ZeRO-2/3 under pipeline parallelism shards each layer of a stage "
                f"as one FSDP2 unit (a unit run at several depths would be gathered, resharded and reduce-scattered "
                f"per use); use zero_stage=1 (or 0) with pipeline parallelism for it, or stages in which each rank "
                f"runs each layer group once")


class AlbertStages:
    """``pipeline_stages`` of every ALBERT head (mixed in before ``EncoderPipelineAdapter``): flat layers are the
    depth over the shared groups."""

    def layer_ids(self, model) -> list[tuple[str, int]]:
        config, path = model.config, self.layer_paths[0]
        return [(path, group_of_layer(config, i)) for i in range(config.num_hidden_layers)]

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Per flat layer: its group's parameters (every layer runs a whole group: the same compute); the
        embeddings' and the head's as BERT's."""
        group_costs, first, last = super().layer_parameter_counts(model)  # one cost per group module
        return [group_costs[group] for _, group in self.layer_ids(model)], first, last

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        """The tied embedding, and each shared group's parameters one by one (a one-name group: the same key on
        every pipeline rank whose stages run the group); ``TiedCopies`` drops those only one rank holds."""
        from .modeling_albert import AlbertLayerGroup  # (modeling_albert imports this module)

        with torch.device("meta"):  # the names only: every group has the same ones, whatever this rank holds
            inner = [name for name, _ in AlbertLayerGroup(model.config).named_parameters()]
        path = self.layer_paths[0]
        shared = [(f"{path}.{group}.{name}",) for group in range(model.config.num_hidden_groups) for name in inner]
        return [*super().tied_groups(model), *shared]


class AlbertPooling:
    """ALBERT's pooled first token for the pooled heads' rule (``common/loss/head_rules.py``): the base model's
    ``pooler`` linear then ``pooler_activation`` tanh (mixed in before the task head class)."""

    @classmethod
    def pooler_modules(cls) -> dict[str, str]:
        return {"pooler": "albert.pooler", "pooler_activation": "albert.pooler_activation"}

    @classmethod
    def pool(cls, holder, hidden):
        return holder.pooler_activation(holder.pooler(hidden[:, 0]))
