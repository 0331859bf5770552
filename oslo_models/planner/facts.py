"""Facts about a model the planner needs, read from the model itself (built on the meta device), never from tables.

``ModelFacts`` holds one model class and config. What it reads:

- every parameter's full shape and its tensor/expert-parallel ``Layout`` (the model's own plan,
  ``parallel_plan.shard_spec``: the one the loader and saver use), so the local shape under any tp/ep size is the
  layout's ``local_shape``;
- which parameters each pipeline rank keeps: the model is built on the meta device with a *size-only* context
  (every axis has its size and rank but no process group, so nothing communicates) and the pipeline's own
  ``keep_stage_modules`` prunes it, exactly as on a launched rank;
- per-token FLOPs and activation bytes from the config (hidden, intermediate, heads, layers, vocab, experts).

Building on meta allocates nothing; a 100-layer model builds in about a second. Results are cached on the instance
(no global state).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from ..config import ParallelConfig


@dataclass(frozen=True)
class ParamFact:
    """One parameter as a pipeline rank holds it before tensor/expert parallelism splits it."""

    name: str
    full_shape: tuple[int, ...]
    layout: object  # parallel_layers.sharding.Layout
    element_size: int
    expert: bool  # split over the expert-parallel axis (reduced and sharded over edp, not dp)

    def local_shape(self, tp: int = 1, ep: int = 1, etp: int = 1) -> tuple[int, ...]:
        """The shape one rank holds under tensor parallelism ``tp`` (1D), expert parallelism ``ep`` and expert
        tensor parallelism ``etp`` (the layout's own arithmetic: padded vocabularies, replicated kv heads...)."""
        return tuple(self.layout.local_shape_in(self.full_shape, _SizeContext(tp=tp, ep=ep, etp=etp)))


class _AxisSize:
    def __init__(self, size: int):
        self.group, self.size, self.rank, self.ranks = None, size, 0, tuple(range(size))


class _SizeContext:
    """Just enough of a ``ParallelContext`` for ``Layout.local_shape_in``: axis sizes, rank 0, no groups."""

    def __init__(self, **sizes: int):
        self._sizes = sizes

    def axis(self, name: str) -> _AxisSize:
        return _AxisSize(self._sizes.get(name, 1))

    @property
    def tp_size(self) -> int:
        return self._sizes.get("tp", 1)


def _virtual_context(parallel: ParallelConfig, pp_rank: int):
    """A ``ParallelContext`` of one pipeline rank with no process group (tensor parallelism off: sizes are applied
    by the layouts afterwards). Used only to build and prune a model on the meta device."""
    from ..distributed.context import EXPERT_AXES, MESH_AXES, AxisInfo, ParallelContext

    pp = parallel.pipeline_parallel_size
    axes = {name: AxisInfo(None, 1, 0, (0,)) for name in MESH_AXES + EXPERT_AXES + ("dp_cp",)}
    axes["pp"] = AxisInfo(None, pp, pp_rank, tuple(range(pp)))
    return ParallelContext(parallel, world_size=pp, rank=pp_rank, device=torch.device("meta"), axes=axes)


class ModelFacts:
    """The planner's view of one model (``model_class`` built from ``config``)."""

    def __init__(self, model_class: type, config, *, dtype: torch.dtype = torch.float32):
        self.model_class, self.config, self.dtype = model_class, config, dtype
        self._cache: dict = {}
        self.cache: dict = {}  # derived figures (memory.training_state) keyed by what they depend on

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained_config(cls, path: str | os.PathLike, *, task: str | None = None,
                               dtype: torch.dtype = torch.float32) -> "ModelFacts":
        """From a model folder or its ``config.json`` (nothing downloaded, no weights read)."""
        from ..models.registry import family_record

        path = str(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json at {path!r}")
        with open(file, encoding="utf-8") as handle:
            values = json.load(handle)
        model_type = values.get("model_type")
        if model_type is None:
            raise ValueError(f"{file} has no model_type")
        record = family_record(model_type)
        config_class = record.config_class()
        config = config_class.from_dict({k: v for k, v in values.items() if k != "model_type"})
        return cls(record.model_class(task or record.main_task()), config, dtype=dtype)

    def build(self, parallel: ParallelConfig | None = None, pp_rank: int = 0):
        """The model on the meta device as pipeline rank ``pp_rank`` of ``parallel`` holds it, unsplit over tp."""
        parallel = parallel or ParallelConfig()
        with torch.device("meta"):
            model = self.model_class(self.config, parallel_context=_virtual_context(parallel, pp_rank))
        return model.to(self.dtype)

    # ------------------------------------------------------------------ parameters
    def parameters(self, pipeline_parallel_size: int = 1, pp_rank: int = 0, *, virtual_pipeline_size: int = 1,
                   pipeline_partition="uniform", pipeline_schedule: str = "1f1b") -> list[ParamFact]:
        """The parameters pipeline rank ``pp_rank`` holds (every parameter when ``pipeline_parallel_size == 1``),
        in ``model.parameters()`` order (the order optimizers and ZeRO-1 see them).

        The model is built once (unsplit); a pipeline rank's share is read off it with the pipeline's own
        functions (``build_layout``, the adapter's layer ids and stage modules), the same ones
        ``keep_stage_modules`` prunes a launched rank with (``pipeline_members`` builds the pruned model instead;
        the tests check the two agree)."""
        key = (pipeline_parallel_size, pp_rank, virtual_pipeline_size, pipeline_partition)
        if key in self._cache:
            return self._cache[key]
        model, facts = self._whole()
        if pipeline_parallel_size == 1:
            return facts
        from ..pipeline.adapter import adapter_for
        from ..pipeline.stage import build_layout

        parallel = _pipeline_config(pipeline_parallel_size, virtual_pipeline_size, pipeline_partition,
                                    pipeline_schedule)
        adapter = adapter_for(model)
        layout = build_layout(model, _virtual_context(parallel, pp_rank))
        ids = adapter.layer_ids(model)
        local = tuple(f"{path}.{index}." for path, index in (ids[i] for i in layout.local_layers()))
        needed = {path for stage in layout.local_stages
                  for path in adapter.stage_modules(model, layout, stage).values()}
        dropped = tuple(path + "." for path in adapter.optional_modules(model, layout) - needed)
        containers = tuple(path + "." for path in adapter.layer_paths)
        kept = [fact for fact in self._all_names(model, facts)
                if fact.name.startswith(local) or not fact.name.startswith(containers + dropped)]
        self._cache[key] = kept
        return kept

    def pipeline_members(self, pipeline_parallel_size: int, pp_rank: int, **options) -> list[str]:
        """Parameter names of ``pp_rank`` read from the model built *pruned*, as a launched rank builds it."""
        parallel = _pipeline_config(pipeline_parallel_size, options.get("virtual_pipeline_size", 1),
                                    options.get("pipeline_partition", "uniform"),
                                    options.get("pipeline_schedule", "1f1b"))
        return [name for name, _ in self.build(parallel, pp_rank).named_parameters()]

    def _whole(self):
        if "whole" not in self._cache:
            model = self.build()
            plan = model.parallel_plan
            facts = []
            for name, param in model.named_parameters():
                layout = plan.shard_spec(model, name)
                facts.append(ParamFact(name, tuple(param.shape), layout, param.element_size(),
                                       getattr(layout, "axis", "tp") == "ep"))
            self._cache["whole"] = (model, facts)
        return self._cache["whole"]

    def _all_names(self, model, facts: list[ParamFact]) -> list[ParamFact]:
        """``facts`` with tied copies listed under each of their names (pipeline stages hold one copy each)."""
        by_id = {}
        for name, param in model.named_parameters():
            by_id[id(param)] = name
        first = {fact.name: fact for fact in facts}
        out = []
        for name, param in model.named_parameters(remove_duplicate=False):
            fact = first[by_id[id(param)]]
            out.append(fact if fact.name == name else ParamFact(name, fact.full_shape, fact.layout,
                                                                 fact.element_size, fact.expert))
        return out

    @property
    def num_parameters(self) -> int:
        return sum(_numel(p.full_shape) for p in self.parameters())

    # ------------------------------------------------------------------ shapes from the config
    def _get(self, *names, default=None):
        for name in names:
            value = getattr(self.config, name, None)
            if value is not None:
                return value
        return default

    @property
    def hidden_size(self) -> int:
        return self._get("hidden_size", "n_embd", "d_model")

    @property
    def num_layers(self) -> int:
        return self._get("num_hidden_layers", "n_layer", "num_layers")

    @property
    def num_heads(self) -> int:
        return self._get("num_attention_heads", "n_head", "num_heads")

    @property
    def num_kv_heads(self) -> int:
        return self._get("num_key_value_heads", default=self.num_heads)

    @property
    def head_dim(self) -> int:
        """The attention head width: the config's ``head_dim`` where it sets one (Gemma, Qwen3: heads x head_dim
        need not be the hidden size), else ``hidden / heads``."""
        return getattr(self.config, "head_dim", None) or self.hidden_size // self.num_heads

    @property
    def intermediate_size(self) -> int:
        return self._get("intermediate_size", "n_inner", "d_ff", default=4 * self.hidden_size)

    @property
    def vocab_size(self) -> int:
        return self._get("vocab_size")

    @property
    def num_experts(self) -> int:
        return self._get("num_local_experts", "num_experts", "n_routed_experts", default=0)

    @property
    def experts_per_token(self) -> int:
        return self._get("num_experts_per_tok", "moe_top_k", default=1 if self.num_experts else 0)

    def active_parameters(self) -> int:
        """Parameters one token passes through: experts count ``experts_per_token / num_experts`` of theirs."""
        if "active" in self.cache:
            return self.cache["active"]
        total = 0
        for p in self.parameters():
            n = _numel(p.full_shape)
            total += n * self.experts_per_token // self.num_experts if p.expert and self.num_experts else n
        self.cache["active"] = total
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 x forward): ``6 x`` active parameters (each weight
        entry is one multiply-add forward, two backward) plus attention's scores and weighted sum,
        ``2 x 2 x seq x hidden`` per layer forward, causal half counted (``x 1/2``). Embedding lookups are counted
        as matmuls (a small overestimate, kept for simplicity)."""
        attention = 2 * 2 * seq_len * self.hidden_size * self.num_layers / 2
        return 3 * (2 * self.active_parameters() + attention)

    def activation_bytes_per_token_per_layer(self, seq_len: int, *, tp: int = 1, sequence_parallel: bool = False,
                                             element_size: int | None = None) -> float:
        """Bytes one pre-norm block saves for backward per token (no checkpointing), counted from what the shared
        stack's autograd graph keeps (read off ``saved_tensors_hooks`` on the tiny Llama, per token, ``h`` hidden,
        ``h_kv`` key/value width, ``f`` intermediate, ``a`` heads):

        - input norm: its input, ``1/rms`` (one float), its output and the q/k/v projections' input: ``3h + 1``;
        - attention: rotated q and k, v, SDPA's output and log-sum-exp, o_proj's input:
          ``3 a d + 2 h_kv + a`` (``d`` the head width; split by tp, but a rank keeps at least one key/value head:
          with fewer key/value heads than tp ranks they are replicated);
        - post-attention norm: ``1/rms``, output, the MLP's input: ``2h + 1``;
        - MLP: gate and up outputs, the activation, down_proj's input: ``4f`` gated (``2f`` plain), split by tp.

        The norm terms are split by tp under sequence parallelism only, except the projections' inputs: there the
        block all-gathers each norm output once and keeps that full copy for all the column-parallel linears reading
        it (q, k, v; gate, up: ``SequenceParallelRegion.enter_tensor_parallel``), so one copy serves the attention
        and one the MLP, as without sp (``gathered_inputs``; measured with the saved-tensor hooks at tp 2,
        tests/planner/test_memory_measured.py). ``seq_len`` does not enter: SDPA keeps no ``s x s`` score matrix
        (flash / memory-efficient kernels, and the CPU path keep the log-sum-exp only)."""
        size = element_size or torch.empty((), dtype=self.dtype).element_size()
        h, a, d = self.hidden_size, self.num_heads, self.head_dim
        key_values = 2 * d * max(1, self.num_kv_heads // tp)  # this rank's k and v (replicated below one head)
        split = 3 * a * d + a + self.mlp_elements_per_token()
        if sequence_parallel and tp > 1:
            return size * (split / tp + key_values + (3 * h + 2) / tp + self.gathered_inputs() * h)
        return size * (split / tp + key_values + 5 * h + 2)

    def mlp_elements_per_token(self) -> int:
        """Elements the feed-forward saves per token inside it (its input not counted): gate and up outputs, the
        activation, down_proj's input: ``4f`` gated (``2f`` plain), times the experts a token runs; split by tp. A
        tiled MLP (``ParallelConfig.tiled_mlp``) keeps none of them."""
        gated = self._get("hidden_act", "activation_function", default="") in ("silu", "swiglu")
        mlp = (4 if gated else 2) * self.intermediate_size
        return mlp * self.experts_per_token if self.num_experts else mlp

    def gathered_inputs(self) -> int:
        """Distinct block inputs the column-parallel linears all-gather under sequence parallelism: the attention's
        and the MLP's (one for a block with a single column-parallel linear)."""
        return min(2, self.column_parallel_inputs())

    def column_parallel_inputs(self) -> int:
        """Column-parallel (``Colwise``) linears per block, from the model's own tensor-parallel plan (2 if the plan
        names none)."""
        if "colwise" not in self.cache:
            styles = self._whole()[0].parallel_plan.styles
            count = sum(1 for pattern, style in styles.items()
                        if ".*." in pattern and "Colwise" in type(style).__name__)
            self.cache["colwise"] = count or 2
        return self.cache["colwise"]

    def outside_layers_bytes_per_token(self, *, tp: int = 1, sequence_parallel: bool = False,
                                       element_size: int | None = None, tiled_loss: bool = False) -> float:
        """Bytes per token saved outside the blocks (single stage): the final norm (``3h + 1``; under sequence
        parallelism its input, ``1/rms`` and output split by tp, and the head's all-gathered input whole), the fp32
        logits (``vocab / tp``, padded), the token ids and labels (int64). ``tiled_loss`` (the heads'
        ``skip_logits=True``): no logits; the chunked loss keeps the hidden states' gradient (``h``) instead, and
        a ``[V / tp, h]`` fp32 weight-gradient accumulator per step (``tiled_loss_fixed_bytes``)."""
        size = element_size or torch.empty((), dtype=self.dtype).element_size()
        vocab = -(-self.vocab_size // tp)
        h = self.hidden_size
        norm = (2 * h + 1) / tp + h if sequence_parallel and tp > 1 else 3 * h + 1
        return size * norm + (size * h if tiled_loss else 4 * vocab) + 16

    def tiled_loss_fixed_bytes(self, *, tp: int = 1) -> int:
        """The chunked loss's fp32 ``[V / tp, h]`` weight-gradient accumulator (kept from forward to backward)."""
        return 4 * -(-self.vocab_size // tp) * self.hidden_size


def _pipeline_config(pp: int, v: int, partition, schedule: str) -> ParallelConfig:
    return ParallelConfig(pipeline_parallel_size=pp, virtual_pipeline_size=v, pipeline_partition=partition,
                          pipeline_schedule=schedule if v == 1 else "interleaved_1f1b", num_microbatches=pp * v)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
