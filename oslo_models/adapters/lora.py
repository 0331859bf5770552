"""LoRA (``peft``) on the tensor-parallel linear layers, with the sharding rules of Megatron-LM / NeMo.

``peft`` knows ``nn.Linear``; our parallel layers hold a slice of the weight, so ``peft``'s default LoRA layer would
build adapters of the local sizes and compute them without the collectives they need. ``ParallelLoraLinear`` is a
``peft.tuners.lora.Linear`` registered through ``peft``'s public custom-module mapping
(``LoraConfig._register_custom_module``, done by ``lora_config`` / ``register_parallel_layers``); ``peft`` then
builds, trains, merges and unloads it like its own layer. Nothing is patched and no state is global.

Shapes (``r`` the rank, ``tp`` the tensor-parallel size; LoRA's ``A`` is ``[r, in]``, ``B`` is ``[out, r]`` as
``nn.Linear`` weights, whatever the base layer's weight layout):

- column-parallel base (``ColumnParallelLinear``, ``KVHeadColumnParallelLinear``, the vocabulary-parallel head):
  ``A`` replicated ``[r, in]``; ``B`` split by output like the base weight's rows: ``[out/tp, r]`` (packed q|k|v
  per block, whole key/value heads, padded vocabulary: the base's own ``Layout``). Forward: ``x`` (all-gathered along
  the sequence under sequence parallelism, backward split) -> ``A`` -> ``copy_to_tensor_parallel_region`` (backward
  all-reduce: each rank holds the gradient of its output slice only) -> ``B``. Replicated key/value heads sum the
  gradient of ``B``'s copies over their replica group, as the base weight does.
- row-parallel base (``RowParallelLinear``): ``A`` split by input ``[r, in/tp]``; ``B`` replicated ``[out, r]``.
  Forward: ``A dropout(x_local)`` (``lora_dropout``: this rank's slice of the full-width mask, ``sliced_dropout``)
  (partial sums) -> all-reduce (sequence parallel: reduce-scatter along the sequence) ->
  ``B``; under sequence parallelism ``B``'s gradient is summed over the ranks (each saw its tokens only).
- ``lora_dropout``: a column-parallel layer's input is whole on every tp rank (gathered under sequence
  parallelism), so ``peft``'s dropout draws the single-process mask from the default RNG stream, the same on every
  tp rank; a row-parallel one draws the full-width mask and keeps its slice. With equal RNG states (every rank seeded
  alike) the masks are ``peft``'s on the unsplit model as long as the model draws nothing else from the default
  stream in another order (its own dropout in split regions uses the tp stream: ``parallel_layers/random.py``);
  over data parallelism each replica draws for its own rows, so masks match a single process on that replica's
  rows, not on the global batch.
- a plain ``Linear`` (tp 1, or a replicated module): ``peft``'s own computation; GPT-2's ``conv1d`` weight layout
  merges transposed (``fan_in_fan_out``).

Adapters are initialized exactly as ``peft`` initializes them on the single-process model: full-size ``A`` and
``B`` are built and drawn by ``peft``'s own ``update_layer`` (same shapes, same order, same generator), then sliced.
``load_state_dict`` slices full (saved) tensors to the local piece. ``state_dict()`` holds the adapters *full*: a
state-dict post-hook (``_gather_adapters_hook``, collective over tp and ZeRO-3's dp: every rank takes the state dict)
gathers them, so the standard ``PeftModel.save_pretrained`` on every rank writes a plain ``peft`` adapter (pass
``is_main_process=rank == 0``, else every rank writes the same bytes). Under pipeline parallelism ``peft`` would keep
the entries of the LoRA layers this rank holds (its stage's): refused, ``save_adapter`` collects every stage
(``saving.py``).
``merge`` / ``merge_and_unload`` add the local ``B A`` to the local weight slice, which is the slice of the full
merged weight.

Refused with a reason: DoRA (its magnitude normalizes each column of ``W + BA`` over the full input, a per-forward
collective under row parallelism that is not implemented), ``init_lora_weights`` methods that read the base weight
(PiSSA, OLoRA, LoftQ, EVA, CorDA...: they would see a slice), the other LoRA variants, mixed-adapter batches, and the
2D/2.5D/3D grid layers. rsLoRA (``use_rslora``) works: it only changes the scaling. A plain ``LoraConfig`` (no
custom-module mapping) lets ``peft`` build its own layers, wrong on a split or ``conv1d`` layer: ``peft`` offers a
model no hook before it builds them, so when ``peft`` sets ``model.peft_config`` just after, the model replaces them
by ``ParallelLoraLinear`` with the same adapters (``adopt_adapter_layers``): ``PeftModel.from_pretrained`` and
``get_peft_model`` work at any tp; a fresh adapter keeps ``peft``'s own draws except A of row-parallel layers (drawn
at the local size: drawn again, with a warning; ``lora_config`` gives the exact single-process init).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel
from peft.tuners.lora.layer import Embedding as PeftLoraEmbedding
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..parallel_layers.kv_heads import KVHeadColumnParallelLinear
from ..parallel_layers.layers import Linear
from ..parallel_layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    group_rank,
    group_size,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from ..parallel_layers.sharding import REPLICATED, EvenSplit, HeadSplit, Layout, split_layout
from ..parallel_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel_layers.tensor_parallel_2d import Linear2D, VocabEmbedding2D
from ..parallel_layers.tensor_parallel_3d import Linear3D, VocabEmbedding3D

# init_lora_weights values that only draw from the generator (the others read the base weight)
_SEEDED_INITS = (True, False, "gaussian")


def _base(layer: nn.Module) -> nn.Module:
    return layer.get_base_layer() if isinstance(layer, BaseTunerLayer) else layer


def adapter_layouts(base: nn.Module) -> tuple[Layout, Layout]:
    """``(layout of A's weight [r, in], layout of B's weight [out, r] and bias [out])`` for a base layer."""
    if isinstance(base, RowParallelLinear):
        return EvenSplit(1), REPLICATED
    if isinstance(base, KVHeadColumnParallelLinear):
        return REPLICATED, HeadSplit(0, base.num_heads)
    if isinstance(base, ColumnParallelLinear):
        return REPLICATED, split_layout(0, num_packed=base.num_packed, vocab_size=base.vocab_size)
    return REPLICATED, REPLICATED


def full_features(base: nn.Module) -> tuple[int, int]:
    """``(in, out)`` of the unsplit layer (the single-process model's)."""
    if isinstance(base, RowParallelLinear):
        return base.full_in_features, base.out_features
    if isinstance(base, ColumnParallelLinear):
        return base.in_features, base.full_out_features
    return base.in_features, base.out_features


def refuse_options(config: LoraConfig, where: str) -> None:
    """``NotImplementedError`` for the LoRA options this integration does not compute (see the module docstring)."""
    if config.use_dora:
        raise NotImplementedError(
            f"DoRA (use_dora=True) is not supported on oslo_models layers ({where}): its magnitude vector normalizes "
            "each column of W + BA over the full input dimension, which under tensor parallelism needs a collective "
            "in every forward that is not implemented. Use plain LoRA (use_dora=False); rsLoRA (use_rslora=True) "
            "works")
    if config.init_lora_weights not in _SEEDED_INITS:
        raise NotImplementedError(
            f"init_lora_weights={config.init_lora_weights!r} is not supported on oslo_models layers ({where}): it "
            "derives the adapters from the base weight, of which each rank holds a slice. Initialize with "
            "True / False / 'gaussian', or load an adapter initialized on the single-process model")


class ParallelLoraLinear(PeftLoraLinear):
    """``peft``'s LoRA ``Linear`` on a (tensor-parallel) ``oslo_models`` linear layer; see the module docstring.

    Built by ``peft`` through the custom-module mapping: ``ParallelLoraLinear(target, adapter_name, config=...)``.
    Parameters keep ``peft``'s names (``lora_A.<adapter>.weight`` ...), holding this rank's piece."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs):
        base = _base(base_layer)
        if isinstance(base, (Linear2D, Linear3D)):
            raise NotImplementedError(
                f"LoRA on {type(base).__name__} (tensor_parallel_mode 2d / 2.5d / 3d) is not implemented: its weight "
                "is split in q x q blocks over two axes and the low-rank path would need its own SUMMA products. Use "
                "tensor_parallel_mode='1d' for LoRA")
        self.lora_group = getattr(base, "group", None)
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        # The weight layout decides the merge's transpose, not the config: GPT-2's c_attn is a Linear with the
        # ``conv1d`` layout ([in, out], as transformers' Conv1D), Llama's q_proj the ``linear`` one.
        self.fan_in_fan_out = getattr(base, "layout", "linear") == "conv1d"
        # peft saves ``model.state_dict()``'s adapter entries: they come gathered (plain peft's full tensors)
        self.register_state_dict_post_hook(_gather_adapters_hook)

    # ------------------------------------------------------------------ construction
    def update_layer(self, adapter_name, r, lora_alpha, config, **kwargs):
        """``peft``'s ``update_layer`` at the full (single-process) sizes, so the draws are exactly its own, then
        each adapter weight is replaced by this rank's piece."""
        refuse_options(config, kwargs.get("target_name", type(self.get_base_layer()).__name__))
        if self.resolve_lora_variant(config=config) is not None:
            raise NotImplementedError("LoRA variants (DoRA, aLoRA, Arrow, BD-LoRA, ...) are not supported on "
                                      "oslo_models layers; use plain LoRA")
        local = (self.in_features, self.out_features)
        self.in_features, self.out_features = full_features(self.get_base_layer())
        try:
            super().update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)
        finally:
            self.in_features, self.out_features = local
        for key, layout in self._adapter_param_layouts(adapter_name).items():
            module_name, param_name = key.rsplit(".", 1)
            module = self.get_submodule(module_name)
            full = getattr(module, param_name)
            piece = self._slice(layout, full.data)
            setattr(module, param_name, nn.Parameter(piece.contiguous(), requires_grad=full.requires_grad))
        self.lora_A[adapter_name].in_features = self.lora_A[adapter_name].weight.shape[1]
        self.lora_B[adapter_name].out_features = self.lora_B[adapter_name].weight.shape[0]

    def _adapter_param_layouts(self, adapter_name: str) -> dict[str, Layout]:
        """``{"lora_A.<adapter>.weight": layout, ...}`` for one adapter (names relative to this layer)."""
        layout_a, layout_b = adapter_layouts(self.get_base_layer())
        out = {f"lora_A.{adapter_name}.weight": layout_a, f"lora_B.{adapter_name}.weight": layout_b}
        if self.lora_B[adapter_name].bias is not None:
            out[f"lora_B.{adapter_name}.bias"] = layout_b
        return out

    def adapter_param_layouts(self) -> dict[str, Layout]:
        """The layouts of every adapter parameter of this layer (names relative to it)."""
        out = {}
        for name in self.lora_A:
            out.update(self._adapter_param_layouts(name))
        return out

    def _slice(self, layout: Layout, full: torch.Tensor) -> torch.Tensor:
        return layout.read_shard(tuple(full.shape), lambda index: full[index], group_rank(self.lora_group),
                                 group_size(self.lora_group))

    def gather_adapter(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The full tensor of adapter parameter ``key`` from every rank's piece. Collective over the TP group."""
        return self.adapter_param_layouts()[key].gather(local, self.lora_group)

    def gathered_state(self, state_dict: dict, prefix: str) -> None:
        """Replace this layer's adapter entries of ``state_dict`` by their full tensors (in place): ZeRO-3 (FSDP2)
        shards all-gathered over data parallelism, then the tensor-parallel pieces joined by their ``Layout``.
        Collective over the TP (and ZeRO-3) group: every rank that takes a state dict takes part."""
        for key in self.adapter_param_layouts():
            tensor = state_dict.get(prefix + key)
            if tensor is None:
                continue
            tensor = tensor.detach()
            if hasattr(tensor, "full_tensor"):  # a ZeRO-3 (FSDP2) DTensor: gather its data-parallel shards
                tensor = tensor.full_tensor()
            if group_size(self.lora_group) > 1:
                tensor = self.gather_adapter(key, tensor)
            state_dict[prefix + key] = tensor

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A saved adapter holds full tensors: keep this rank's piece (a local piece, e.g. a resumed training
        # state, loads as is). Runs before the children load, which read the rewritten entries.
        size = group_size(self.lora_group)
        for key, layout in self.adapter_param_layouts().items():
            tensor = state_dict.get(prefix + key)
            local_shape = tuple(self.get_parameter(key).shape)
            if tensor is None or tuple(tensor.shape) == local_shape:
                continue
            if tuple(tensor.shape) == layout.full_shape(local_shape, size):
                state_dict[prefix + key] = self._slice(layout, tensor)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The base layer's output (its own collectives, ``sequence_parallel`` honoured) plus each active adapter's
        ``scaling * B(A(dropout(x)))``, computed with the collectives of the module docstring."""
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError("mixed-adapter batches (adapter_names=...) are not supported on oslo_models "
                                      "layers; activate one adapter set with set_adapter()")
        base = self.get_base_layer()
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return base(x, *args, **kwargs)
        result = base(x, *args, **kwargs)
        if self.merged:
            return result
        sp_active = getattr(base, "sequence_parallel_active", None)
        sequence_parallel = bool(sp_active(kwargs.get("sequence_parallel"))) if sp_active is not None else False
        dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            delta = self._lora_path(x.to(self.lora_A[name].weight.dtype), name, sequence_parallel)
            result = result + delta * self.scaling[name]
        return result.to(dtype)

    def _lora_path(self, x: torch.Tensor, name: str, sequence_parallel: bool) -> torch.Tensor:
        base, group = self.get_base_layer(), self.lora_group
        lora_a, lora_b, dropout = self.lora_A[name], self.lora_B[name], self.lora_dropout[name]
        if isinstance(base, RowParallelLinear):
            a = lora_a(sliced_dropout(dropout, x, group))  # [b, s, r] partial sums over this rank's input slice
            weight, bias = lora_b.weight, lora_b.bias
            if sequence_parallel:
                a = reduce_scatter_to_sequence_parallel_region(a, group)  # [b, s/tp, r]
                weight = copy_to_tensor_parallel_region(weight, group)  # this rank's tokens only: sum the grads
                bias = copy_to_tensor_parallel_region(bias, group) if bias is not None else None
            else:
                a = reduce_from_tensor_parallel_region(a, group)
            return F.linear(a, weight, bias)
        if isinstance(base, ColumnParallelLinear):
            if sequence_parallel:  # the gradient of the gathered x is complete (see below): split, not reduce
                x = gather_from_sequence_parallel_region(x, group, grad_is_partial=False)
            a = copy_to_tensor_parallel_region(lora_a(dropout(x)), group)  # backward: sum the output slices' grads
            weight, bias = lora_b.weight, lora_b.bias
            replica_group = getattr(base, "replica_group", None)
            if replica_group is not None:  # replicated key/value heads: sum the copies' gradients
                weight = copy_to_tensor_parallel_region(weight, replica_group)
                bias = copy_to_tensor_parallel_region(bias, replica_group) if bias is not None else None
            y = F.linear(a, weight, bias)  # [b, s, out/tp]
            if base.gather_output:
                y = base.gather(y)
            return y
        return lora_b(lora_a(dropout(x)))


def _gather_adapters_hook(module: ParallelLoraLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook: the adapter entries are the full tensors (``ParallelLoraLinear.gathered_state``),
    so ``PeftModel.save_pretrained`` / ``get_peft_model_state_dict`` write a plain ``peft`` adapter at any layout.
    Base weights stay this rank's pieces (``save_pretrained`` of the model gathers those)."""
    module.gathered_state(state_dict, prefix)


def sliced_dropout(dropout: nn.Module, x: torch.Tensor, group) -> torch.Tensor:
    """``dropout`` of this rank's feature slice ``x [..., in/tp]`` with this rank's slice of the mask the
    single-process layer would draw for the whole ``[..., in]``: the full mask is drawn (from the default stream,
    the same on every tp rank) by ``F.dropout`` of ones, then sliced. Same draws, same scaling, so the masks equal
    ``peft``'s on the unsplit model for the same RNG state (costs one full-width mask per rank)."""
    p = getattr(dropout, "p", 0.0)
    if not isinstance(dropout, nn.Dropout) or not dropout.training or p == 0.0 or group_size(group) == 1:
        return dropout(x)
    width = x.shape[-1]
    noise = F.dropout(x.new_ones(*x.shape[:-1], width * group_size(group)), p, True)
    return x * noise.narrow(-1, group_rank(group) * width, width)


def _lora_embedding(base_layer: nn.Module, adapter_name: str, config: LoraConfig, **kwargs) -> nn.Module:
    """``peft``'s LoRA ``Embedding`` on a whole table (tp 1); a vocabulary split over ranks is refused."""
    base = _base(base_layer)
    if getattr(base, "tp_size", 1) > 1 or isinstance(base, (VocabEmbedding2D, VocabEmbedding3D)):
        raise NotImplementedError(
            f"LoRA on a vocabulary-parallel embedding ({type(base).__name__} at tensor_parallel_size > 1) is not "
            "implemented: leave the embeddings out of target_modules (or train them with modules_to_save at tp 1)")
    refuse_options(config, type(base).__name__)
    return PeftLoraEmbedding(base_layer, adapter_name, config=config, **kwargs)


PLAIN_CONFIG_NOTE = (
    "peft built its own LoRA layers on {names} (a plain peft.LoraConfig: peft 0.21 lets a model choose its LoRA "
    "layers only through the config's custom-module mapping); oslo_models replaced them by ParallelLoraLinear. peft "
    "drew those adapters at the tensor-parallel local sizes, so a fresh adapter is a valid initialization, the same on "
    "every rank, but not bit-identical to plain peft's on the single-process model (a loaded adapter is unaffected: "
    "PeftModel.from_pretrained loads its tensors next). For peft's exact initialization use "
    "peft.get_peft_model(model, oslo_models.adapters.lora_config(...))")


def _needs_parallel_layer(base: nn.Module) -> bool:
    """Whether ``peft``'s own LoRA layer would compute ``base`` wrong: split over tensor parallelism, or a
    ``conv1d``-layout weight (merged without the transpose)."""
    if not isinstance(base, (Linear, VocabParallelEmbedding, VocabEmbedding2D, VocabEmbedding3D)):
        return False
    split = group_size(getattr(base, "group", None)) > 1 or getattr(base, "tp_size", 1) > 1
    return split or getattr(base, "layout", "linear") == "conv1d"


def _adopt(module: PeftLoraLinear, configs: dict) -> tuple[nn.Module, bool]:
    """A ``ParallelLoraLinear`` with ``module``'s adapters (``peft``'s own ``Linear`` on an ``oslo_models`` layer),
    and whether the result is ``peft``'s single-process initialization. ``peft`` built A and B at the layer's *local*
    ``in_features`` / ``out_features``; every tensor whose shape is this rank's piece is kept (they are the same on
    every rank: each drew the same sequence). A of a row-parallel layer (``[r, in/tp]`` drawn, ``[r, in/tp]`` piece
    of a ``[r, in]`` draw wanted) is drawn again at full size inside ``fork_rng`` (the run's RNG stream untouched) and
    sliced. Exact only when the layer is not split (a ``conv1d``-layout weight at tp 1): split, the local shapes
    changed the draws ``nn.Linear`` and ``peft`` made."""
    base = module.get_base_layer()
    if not isinstance(base, Linear):
        raise NotImplementedError(
            f"LoRA with a plain peft.LoraConfig on {type(base).__name__} at tensor_parallel_size > 1 is not "
            "implemented (peft built its own layer on a split table): leave it out of target_modules")
    with torch.random.fork_rng(devices=[]):
        new = None
        for name in module.lora_A:
            options = dict(r=module.r[name], lora_alpha=module.lora_alpha[name], config=configs[name])
            if new is None:
                new = ParallelLoraLinear(base, name, **options)
            else:
                new.update_layer(name, options.pop("r"), **options)
    exact = group_size(new.lora_group) == 1
    for name in module.lora_A:
        layout_a, _ = adapter_layouts(base)
        pairs = [(new.lora_A[name].weight, module.lora_A[name].weight, layout_a is REPLICATED),
                 (new.lora_B[name].weight, module.lora_B[name].weight, True)]
        if module.lora_B[name].bias is not None:
            pairs.append((new.lora_B[name].bias, module.lora_B[name].bias, True))
        for target, drawn, keep in pairs:
            if keep and target.shape == drawn.shape:
                target.data.copy_(drawn.data)
            target.requires_grad_(drawn.requires_grad)
    new.set_adapter(module.active_adapters)
    new._disable_adapters = module.disable_adapters
    return new, exact


def adopt_adapter_layers(model: nn.Module) -> None:
    """Replace the LoRA layers ``peft`` built itself (a plain ``LoraConfig``) on ``oslo_models`` layers it would
    compute wrong (split over tensor parallelism, or a ``conv1d`` weight) by ``ParallelLoraLinear`` with the same
    adapters. Called when ``peft`` sets ``model.peft_config``, right after building its layers and before
    ``PeftModel.from_pretrained`` loads an adapter's tensors (which then load sliced). Warns when a fresh adapter's
    initialization could not be kept (``PLAIN_CONFIG_NOTE``). The model also gets the guard that refuses ``peft``'s
    own adapter export when pipelined (it would save one stage) and a lone rank's gathering state dict
    (``saving.guard_adapter_export``)."""
    from .saving import guard_adapter_export

    guard_adapter_export(model)
    configs = model.peft_config
    replaced, inexact = [], []
    for name, module in list(model.named_modules()):
        if not isinstance(module, BaseTunerLayer) or isinstance(module, ParallelLoraLinear):
            continue
        if not _needs_parallel_layer(module.get_base_layer()):
            continue
        if not isinstance(module, PeftLoraLinear):
            raise NotImplementedError(
                f"peft built a {type(module).__name__} on {name}, an oslo_models layer split over tensor "
                "parallelism; LoRA there needs oslo_models.adapters.lora_config(...) (or leave it out of "
                "target_modules)")
        new, exact = _adopt(module, configs)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        replaced.append(name)
        if not exact:
            inexact.append(name)
    if inexact:
        shown = ", ".join(inexact[:3]) + (f" (+{len(inexact) - 3} more)" if len(inexact) > 3 else "")
        warnings.warn(PLAIN_CONFIG_NOTE.format(names=shown), stacklevel=3)


def register_parallel_layers(config: LoraConfig) -> LoraConfig:
    """Register ``ParallelLoraLinear`` for the ``oslo_models`` linear layers on ``config`` (in place; returned).
    Uses ``peft``'s custom-module mapping, which is not written to ``adapter_config.json``: the saved config is a
    plain ``peft`` one."""
    if not isinstance(config, LoraConfig):
        raise TypeError(f"oslo_models adapters support LoRA (peft.LoraConfig), got {type(config).__name__}")
    # First match wins (isinstance): grid and parallel layers before the plain Linear they subclass.
    config._register_custom_module({
        Linear2D: ParallelLoraLinear, Linear3D: ParallelLoraLinear,  # refused in __init__, with the reason
        ColumnParallelLinear: ParallelLoraLinear, RowParallelLinear: ParallelLoraLinear, Linear: ParallelLoraLinear,
        VocabParallelEmbedding: _lora_embedding, VocabEmbedding2D: _lora_embedding, VocabEmbedding3D: _lora_embedding,
    })
    return config


def lora_config(**kwargs) -> LoraConfig:
    """``peft.LoraConfig(**kwargs)`` that knows the ``oslo_models`` parallel layers (``register_parallel_layers``)."""
    return register_parallel_layers(LoraConfig(**kwargs))


def load_adapter(model: nn.Module, model_id: str | os.PathLike, adapter_name: str = "default", *,
                 is_trainable: bool = False, **kwargs) -> PeftModel:
    """``peft.PeftModel.from_pretrained(model, model_id, ...)`` with the saved ``LoraConfig`` registered for the
    parallel layers: each rank loads the full tensors and keeps its piece. ``kwargs`` go to ``from_pretrained``."""
    config = register_parallel_layers(LoraConfig.from_pretrained(model_id))
    return PeftModel.from_pretrained(model, model_id, adapter_name=adapter_name, is_trainable=is_trainable,
                                     config=config, **kwargs)
