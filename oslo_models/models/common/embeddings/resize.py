"""``resize_token_embeddings`` for vocab-parallel models: the same new weights as ``transformers``, re-split.

Under tensor parallelism the input embedding (and an untied LM head with its bias) holds ``V_padded/tp`` rows per
rank, padded to a multiple of ``tp``. Resizing to ``V'`` therefore cannot edit the local table in place:

1. gather the full ``[V, h]`` weight (and the head's ``[V, h]`` weight and ``[V]`` bias) over the TP group
   (all-gather; the padding rows are stripped), into plain ``nn.Embedding`` / ``nn.Linear`` modules;
2. let ``transformers`` resize those exactly as it resizes its own model (``_get_resized_embeddings`` /
   ``_get_resized_lm_head``: new rows drawn from the old rows' mean and covariance, over the *full* vocabulary,
   or ``initializer_range`` normals with ``mean_resizing=False``), drawing from the same torch RNG stream;
3. broadcast the new full tensors from global rank 0, so every rank holds the same values even where the ranks'
   default RNG streams differ;
4. rebuild the layer through the model's ``ParallelPlan`` style for that module name (the padding recomputed for
   ``V'``), keep this rank's slice, install it with ``set_input_embeddings`` / ``set_output_embeddings`` and tie.

Cost: one all-gather of the old tables and one broadcast of the new ones (``V' x h`` each), plus a full copy of
each table in host/device memory on every rank while it runs. Collective: call on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ....parallel_layers.layers import Embedding, Linear
from ....parallel_layers.sharding import REPLICATED


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for name, candidate in model.named_modules(remove_duplicate=False):
        if candidate is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}")


def _full_tensor(model, module_name: str, leaf: str, local: torch.Tensor) -> torch.Tensor:
    """The full (unpadded) tensor of parameter ``module_name.leaf`` (all-gather over TP, or the grid's axes)."""
    spec = model.parallel_plan.shard_spec(model, f"{module_name}.{leaf}" if module_name else leaf)
    return spec.gather_local(local.detach(), model.parallel_context).clone()


def _plain_embedding(model, module: nn.Embedding) -> nn.Embedding:
    weight = _full_tensor(model, _module_name(model, module), "weight", module.weight)
    padding_idx = getattr(module, "padding_idx_full", module.padding_idx)
    return nn.Embedding(weight.shape[0], weight.shape[1], padding_idx=padding_idx, _weight=weight,
                        device=weight.device, dtype=weight.dtype)


def _plain_linear(model, module) -> nn.Linear:
    name = _module_name(model, module)
    weight = _full_tensor(model, name, "weight", module.weight)
    if getattr(module, "layout", "linear") == "conv1d":
        weight = weight.t()
    plain = nn.Linear(0, 0, bias=module.bias is not None, device="meta")  # no RNG draw: filled right below
    plain.in_features, plain.out_features = weight.shape[1], weight.shape[0]
    plain.weight = nn.Parameter(weight.contiguous())
    if module.bias is not None:
        plain.bias = nn.Parameter(_full_tensor(model, name, "bias", module.bias))
    return plain


def _broadcast(tensors: list[torch.Tensor]) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def _parallel_copy(model, name: str, plain: nn.Module, layout: str = "linear") -> nn.Module:
    """``plain`` (full weights) rebuilt as the plan's layer for ``name`` and filled with this rank's slices."""
    if isinstance(plain, nn.Embedding):
        ours = Embedding(plain.num_embeddings, plain.embedding_dim, padding_idx=plain.padding_idx, device="meta")
    else:
        ours = Linear(plain.in_features, plain.out_features, bias=plain.bias is not None, layout=layout,
                      device="meta")
    context = model.parallel_context
    style = model.parallel_plan.style_for(name)
    built = style.build(ours, context) if style is not None else ours
    specs = style.shard_specs(built) if style is not None else {}
    device, dtype = plain.weight.device, plain.weight.dtype
    built.to_empty(device=device)
    with torch.no_grad():
        for leaf, param in list(built.named_parameters(recurse=False)):
            full = getattr(plain, leaf).detach()
            if leaf == "weight" and layout == "conv1d":
                full = full.t()
            local = specs.get(leaf, REPLICATED).read_local(tuple(full.shape), lambda index, f=full: f[index],
                                                             context)
            setattr(built, leaf, nn.Parameter(local.to(dtype).contiguous(), requires_grad=param.requires_grad))
    return built


def resize_token_embeddings(model, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                            mean_resizing: bool = True) -> nn.Module:
    """See the module docstring; the signature and return value are ``PreTrainedModel.resize_token_embeddings``'s
    (the input embedding module, here the rebuilt vocab-parallel one)."""
    if model.parallel_context.pp_size > 1:
        raise ValueError("resize_token_embeddings is not supported on a pipeline-parallel model (the embeddings "
                         "and the head live on different stages): resize before splitting, save, and reload")
    old_input = model.get_input_embeddings()
    if new_num_tokens is None and pad_to_multiple_of is None:
        return old_input
    input_name = _module_name(model, old_input)
    requires_grad = old_input.weight.requires_grad
    plain_input = model._get_resized_embeddings(_plain_embedding(model, old_input), new_num_tokens,
                                                pad_to_multiple_of, mean_resizing)
    new_num_tokens = plain_input.weight.shape[0]
    old_output = model.get_output_embeddings()
    plain_output = None
    if old_output is not None:
        plain_output = _plain_linear(model, old_output)
        if plain_output.out_features != new_num_tokens:
            plain_output = model._get_resized_lm_head(plain_output, new_num_tokens, mean_resizing=mean_resizing)
    _broadcast([p for module in (plain_input, plain_output) if module is not None for p in module.parameters()])

    new_input = _parallel_copy(model, input_name, plain_input)
    new_input.requires_grad_(requires_grad)
    model.set_input_embeddings(new_input)
    if old_output is not None:
        output_name = _module_name(model, old_output)
        new_output = _parallel_copy(model, output_name, plain_output, getattr(old_output, "layout", "linear"))
        new_output.requires_grad_(old_output.weight.requires_grad)
        model.set_output_embeddings(new_output)
    for module in model.modules():  # the stacks of T5 carry their own copy of the config
        if hasattr(module, "config") and hasattr(module.config, "vocab_size"):
            module.config.vocab_size = new_num_tokens
    model.config.get_text_config().vocab_size = new_num_tokens
    model.vocab_size = new_num_tokens
    model.tie_parallel_weights()
    return model.get_input_embeddings()
