"""Block templates: the few shapes a Hub decoder or encoder layer takes, written once.

A family names its layer class after ``transformers``' (``LlamaDecoderLayer``, ``GPT2Block``) by subclassing a
template and giving ``names``, the ``transformers`` attribute of each role, so the module tree and the state-dict
keys stay exactly ``transformers``'::

    class GPT2Block(PreNormBlock):
        names = dict(attn_norm="ln_1", attn="attn", mlp_norm="ln_2", mlp="mlp")

The family builds the components (``attn``: an attention module returning ``(output, weights)``; ``mlp``; the
norms) and hands them to the template's ``__init__`` by role. Templates:

- ``PreNormBlock``: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (GPT-2, Llama, Mistral, Qwen, Mixtral, OPT,
  Bloom, Falcon with ``parallel_attn=False``); ``residual_after_norm``: ``norm1(x) + attn(norm1(x))`` (Bloom's
  ``apply_residual_connection_post_layernorm``); optional residual dropouts ``attn_dropout`` / ``mlp_dropout`` on
  each branch's output before the add (``ResidualDropout``: Phi-3's ``resid_attn_dropout`` /
  ``resid_mlp_dropout``, StarCoder2's attention one);
- ``ParallelResidualBlock``: ``attn(norm1(x)) + mlp(norm2(x)) + x``, ``mlp_norm`` optional (one shared norm:
  GPT-J, Falcon-7B, Phi; two: GPT-NeoX);
- ``PostNormBlock``: ``norm1(x + attn(x))``, then ``norm2(x + mlp(x))`` (OPT with ``do_layer_norm_before=False``,
  the BERT-style post-norm encoders);
- ``SandwichNormBlock``: ``x + post_attn_norm(attn(pre_attn_norm(x)))``, same around the MLP (Gemma 2/3; OLMo 2
  has only the post norms: leave ``attn_norm``/``mlp_norm`` out).

Every template is a ``GradientCheckpointingLayer`` (activation checkpointing), runs single-device code (parallelism
enters through the layers the plan swapped in and the stack's sequence-parallel region) and takes one signature:
``block(hidden_states [b, s(/tp), h], attention_mask, position_embeddings, past_key_values, **kwargs)`` ->
``hidden_states``. The attention module is called as ``attn(x, attention_mask=..., position_embeddings=...,
past_key_values=..., **kwargs)``; ``mlp_forward`` is the one hook (the MoE decoders pass a router-logit collector).

``tp_plan(components)`` is a block's plan fragment: each component class's own ``tp_plan`` (module pattern relative
to the component -> style) under the attribute that holds it.
"""
from __future__ import annotations

from typing import ClassVar, Mapping

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ....parallel_layers.layers import Dropout
from ....parallel_layers.plan import TPDropout
from ....parallel_layers.tiled_mlp import tiled_module


class BlockTemplate(GradientCheckpointingLayer):
    """Base of the templates: registers the components under ``names`` (in ``roles`` order, as ``transformers``
    registers them, so ``named_parameters`` order matches too) and gives the plan fragment."""

    roles: ClassVar[tuple[str, ...]] = ()
    optional_roles: ClassVar[tuple[str, ...]] = ()
    names: ClassVar[Mapping[str, str]] = {}
    #: keyword arguments of the stack meant for the feed-forward, not the attention (the MoE router-logit collector)
    mlp_kwargs: ClassVar[tuple[str, ...]] = ()
    #: pre-norm only: each residual branch adds to the *normalized* input (Bloom's
    #: ``apply_residual_connection_post_layernorm``); a family sets it per instance from its config
    residual_after_norm: bool = False
    #: the feed-forward's sequence slices in training (``parallel_layers/tiled_mlp.py``: ``None`` whole, an int or
    #: ``"auto"``), set by ``ParallelConfig.tiled_mlp`` (``common/stack/long_sequence.py``)
    mlp_tiles = None

    def __init__(self, *, order: tuple[str, ...] | None = None, **components: nn.Module | None):
        super().__init__()
        unknown = set(components) - set(self.roles)
        missing = set(self.roles) - set(self.optional_roles) - {r for r, m in components.items() if m is not None}
        if unknown or missing:
            raise TypeError(f"{type(self).__name__}: unknown roles {sorted(unknown)}, missing roles {sorted(missing)}")
        for role in order or self.roles:  # ``order``: the family's registration order when it differs
            module = components.get(role)
            if module is not None:
                self.add_module(self.names[role], module)

    def part(self, role: str) -> nn.Module | None:
        return self._modules.get(self.names.get(role, ""), None)

    def residual_dropout(self, role: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the block's dropout module of ``role`` when it has one (Phi-3's residual dropouts)."""
        dropout = self.part(role)
        return dropout(x) if dropout is not None else x

    def split_kwargs(self, kwargs: dict) -> tuple[dict, dict]:
        """``(attention kwargs, feed-forward kwargs)`` of a block call."""
        mlp = {key: kwargs.pop(key) for key in self.mlp_kwargs if key in kwargs}
        return kwargs, mlp

    def attend(self, x, attention_mask, position_embeddings, past_key_values, **kwargs) -> torch.Tensor:
        out, _weights = self.part("attn")(x, attention_mask=attention_mask, position_embeddings=position_embeddings,
                                          past_key_values=past_key_values, **kwargs)
        return out

    def mlp_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The feed-forward on ``x``; ``kwargs``: the call's ``mlp_kwargs``."""
        if self.mlp_tiles is not None and self.training and not kwargs:
            return tiled_module(self.part("mlp"), x, self.mlp_tiles)
        return self.part("mlp")(x, **kwargs)

    @classmethod
    def tp_plan(cls, components: Mapping[str, type | tuple[type, ...]]) -> dict:
        """``{pattern relative to the block: style}`` from each role's component class(es) ``tp_plan``. A role
        named ``""`` keeps its modules on the block itself (OPT's ``fc1``/``fc2``, which ``transformers`` registers
        on the layer): its patterns are taken as they are."""
        plan = {}
        for role, classes in components.items():
            for component in classes if isinstance(classes, tuple) else (classes,):
                for pattern, style in getattr(component, "tp_plan", {}).items():
                    name = cls.names[role]
                    plan[".".join(part for part in (name, pattern) if part)] = style
        return plan


class ResidualDropout(Dropout):
    """Dropout on a branch's output before it joins the residual stream (a block role, see ``PreNormBlock``). The
    stream is whole on every TP rank (same mask on each) or, under sequence parallelism, this rank's chunk of the
    sequence (its own mask): ``TPDropout()``."""

    tp_plan = {"": TPDropout()}


class PreNormBlock(BlockTemplate):
    roles = ("attn_norm", "attn", "mlp_norm", "mlp", "attn_dropout", "mlp_dropout")
    optional_roles = ("attn_dropout", "mlp_dropout")

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        kwargs, mlp_kwargs = self.split_kwargs(kwargs)
        normed = self.part("attn_norm")(hidden_states)
        residual = normed if self.residual_after_norm else hidden_states
        attn_out = self.attend(normed, attention_mask, position_embeddings, past_key_values, **kwargs)
        hidden_states = residual + self.residual_dropout("attn_dropout", attn_out)
        normed = self.part("mlp_norm")(hidden_states)
        residual = normed if self.residual_after_norm else hidden_states
        return residual + self.residual_dropout("mlp_dropout", self.mlp_forward(normed, **mlp_kwargs))


class ParallelResidualBlock(BlockTemplate):
    roles = ("attn_norm", "attn", "mlp_norm", "mlp")
    optional_roles = ("mlp_norm",)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        kwargs, mlp_kwargs = self.split_kwargs(kwargs)
        attn_in = self.part("attn_norm")(hidden_states)
        mlp_norm = self.part("mlp_norm")
        mlp_in = mlp_norm(hidden_states) if mlp_norm is not None else attn_in
        attn_out = self.attend(attn_in, attention_mask, position_embeddings, past_key_values, **kwargs)
        # (attn + mlp) + x: the order GPT-J, GPT-NeoX, Phi and Falcon add in, so fp32 sums are theirs bit for bit
        return attn_out + self.mlp_forward(mlp_in, **mlp_kwargs) + hidden_states


class PostNormBlock(BlockTemplate):
    roles = ("attn", "attn_norm", "mlp", "mlp_norm")

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        kwargs, mlp_kwargs = self.split_kwargs(kwargs)
        attn_out = self.attend(hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)
        hidden_states = self.part("attn_norm")(hidden_states + attn_out)
        return self.part("mlp_norm")(hidden_states + self.mlp_forward(hidden_states, **mlp_kwargs))


class SandwichNormBlock(BlockTemplate):
    roles = ("attn_norm", "attn", "post_attn_norm", "mlp_norm", "mlp", "post_mlp_norm")
    optional_roles = ("attn_norm", "mlp_norm")

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        kwargs, mlp_kwargs = self.split_kwargs(kwargs)
        def pre(role, x):
            norm = self.part(role)
            return norm(x) if norm is not None else x

        attn_out = self.attend(pre("attn_norm", hidden_states), attention_mask, position_embeddings,
                               past_key_values, **kwargs)
        hidden_states = hidden_states + self.part("post_attn_norm")(attn_out)
        mlp_out = self.mlp_forward(pre("mlp_norm", hidden_states), **mlp_kwargs)
        return hidden_states + self.part("post_mlp_norm")(mlp_out)
