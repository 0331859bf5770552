"""Rotary position embeddings of the Llama family: ``transformers``' own module, plus the fused application.

``RotaryEmbedding`` *is* ``transformers``' rotary module (``LlamaRotaryEmbedding``; Mistral, Qwen2 and Qwen3 carry
identical copies), so every ``rope_parameters`` type ``transformers`` knows (default, linear, dynamic, yarn,
longrope, llama3, ...) and the legacy ``rope_scaling``/``rope_theta`` spelling of older ``config.json`` files
(which ``transformers``' config classes standardize on load) give exactly its ``cos``/``sin``: the frequencies
come from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` and the dynamic types update through its
``dynamic_rope_update``, whatever version is installed. Nothing is re-derived here.

What is added is one method, ``reset_buffers``: the frequencies are non-persistent buffers (in no checkpoint), so
a model built on the meta device and then ``to_empty``'d (how every parallel model is built) recomputes them on
its device, in fp32 whatever the model dtype, as ``transformers`` keeps them.

``PartialRotaryEmbedding`` is the same over ``transformers``' GPT-NeoX rotary module, whose default frequencies honour
``rope_parameters["partial_rotary_factor"]`` (GPT-NeoX ``rotary_pct``, Phi, Phi-3, StableLM...): its ``cos``/``sin``
are ``[b, s, rotary_dim]`` with ``rotary_dim = int(head_dim * factor)``, and ``GroupedQueryAttention`` rotates only the
first ``rotary_dim`` dims of each head (``transformers``' rule in those families).

``InterleavedRotaryEmbedding`` is GPT-J's: ``transformers``' ``GPTJRotaryEmbedding`` (a sinusoid table of
``max_position_embeddings x rotary_dim``, a non-persistent buffer) whose ``(sin, cos)`` halves are repeated pairwise
to ``[b, s, rotary_dim]``, so they rotate *interleaved* pairs ``(x[2i], x[2i+1])`` (``rotate_every_two``), not the
two halves of the head: ``apply_rotary(..., interleaved=True)`` (``GroupedQueryAttention(interleaved_rotary=True)``).

``apply_partial_rotary`` is the one place that rotates the first ``cos.shape[-1]`` dims of each head and passes the
rest through (GPT-NeoX ``rotary_pct``, Phi ``partial_rotary_factor``, GPT-J ``rotary_dim``), in either layout.

Under tensor parallelism ``cos``/``sin`` (``[b, s, head_dim]``) are computed for the full sequence on every rank:
the attention runs on full sequences of this rank's heads, so they need no communication and no split.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from .... import fused_ops


class RotaryEmbedding(LlamaRotaryEmbedding):
    """``forward(x, position_ids) -> (cos, sin)``, each ``[b, s, head_dim]`` in ``x``'s dtype (``transformers``')."""

    hf_rotary = LlamaRotaryEmbedding  # the transformers module whose frequencies these are

    def reset_buffers(self) -> None:
        """Recompute ``inv_freq``/``original_inv_freq`` (fp32) on the device the module lives on."""
        device = self.inv_freq.device
        with torch.device("cpu"):
            fresh = self.hf_rotary(self.config)
        self.inv_freq = fresh.inv_freq.to(device)
        self.original_inv_freq = fresh.original_inv_freq.to(device)
        self.attention_scaling = fresh.attention_scaling
        self.max_seq_len_cached = fresh.max_seq_len_cached


class PartialRotaryEmbedding(GPTNeoXRotaryEmbedding):
    """``forward(x, position_ids) -> (cos, sin)``, each ``[b, s, rotary_dim]`` (``partial_rotary_factor``)."""

    hf_rotary = GPTNeoXRotaryEmbedding
    reset_buffers = RotaryEmbedding.reset_buffers


class PerLayerTypeRotary:
    """Mixin over a ``transformers`` rotary module with one frequency set per attention type (Gemma 3's
    ``Gemma3RotaryEmbedding``: ``rope_parameters[layer_type]``, a local base for ``"sliding_attention"`` layers and
    a global one, possibly scaled, for ``"full_attention"``; its ``forward(x, position_ids, layer_type)``).

    ``forward(x, position_ids) -> {attention type: (cos, sin)}``, each ``[b, s, head_dim]`` in ``x``'s dtype, from
    ``transformers``' own forward per type (so every rope type it knows, dynamic ones included); the stack hands
    each layer the pair of its ``attention_type`` (``StackInputs.layer_positions``). ``reset_buffers``: as
    ``RotaryEmbedding``'s, per type. Like the others, no communication under any parallelism.

    Use: ``class Gemma3RotaryEmbedding(PerLayerTypeRotary, transformers_gemma3.Gemma3RotaryEmbedding)`` with
    ``hf_rotary`` the ``transformers`` class."""

    hf_rotary: type

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> dict:
        return {kind: self.hf_rotary.forward(self, x, position_ids, kind) for kind in self.rope_type}

    def reset_buffers(self) -> None:
        """Recompute each type's ``{type}_inv_freq``/``{type}_original_inv_freq`` (fp32) on the module's device."""
        with torch.device("cpu"):
            fresh = self.hf_rotary(self.config)
        for kind in fresh.rope_type:
            for name in (f"{kind}_inv_freq", f"{kind}_original_inv_freq"):
                setattr(self, name, getattr(fresh, name).to(getattr(self, name).device))
            setattr(self, f"{kind}_attention_scaling", getattr(fresh, f"{kind}_attention_scaling"))
        self.max_seq_len_cached = fresh.max_seq_len_cached


class InterleavedRotaryEmbedding(nn.Module):
    """GPT-J's rotary: ``forward(x, position_ids) -> (cos, sin)``, each ``[b, s, rotary_dim]`` with every frequency
    repeated twice in a row (``cos[..., 2i] == cos[..., 2i+1]``), for ``apply_rotary(..., interleaved=True)``.

    The values are ``transformers``' exactly: rows of its sinusoid table (``embed_positions [max_positions,
    rotary_dim]``, fp32, ``sin | cos``) cast to ``x``'s dtype, then ``repeat_interleave`` as GPT-J's
    ``apply_rotary_pos_emb`` does (``GPTJConfig`` requires an integer ``rotary_dim``). Positions past the table
    raise, as in ``transformers``."""

    # written here, not inherited: transformers before 5.2x has no GPTJRotaryEmbedding module (the table was built
    # inside GPTJAttention), and the package must import on those versions too
    def __init__(self, config):
        super().__init__()
        self.max_positions = config.max_position_embeddings
        self.pos_embd_dim = config.rotary_dim or config.hidden_size
        self.register_buffer("embed_positions", create_sinusoidal_positions(self.max_positions, self.pos_embd_dim),
                             persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sincos = self.embed_positions[position_ids].to(x.dtype)  # [b, s, rotary_dim]: sin | cos
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        return cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)

    def reset_buffers(self) -> None:
        """Recompute the non-persistent table on the device the module lives on (fp32, as ``transformers``)."""
        device = self.embed_positions.device
        with torch.device("cpu"):
            table = create_sinusoidal_positions(self.max_positions, self.pos_embd_dim)
        self.embed_positions = table.to(device)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]``: pairs ``(x[2i], x[2i+1])`` -> ``(-x[2i+1], x[2i])`` (GPT-J's ``rotate_every_two``)."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                 fused: bool = False, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers``' ``apply_rotary_pos_emb`` on ``query [b, n_q, s, d]`` and ``key [b, n_kv, s, d]`` (this
    rank's heads). ``fused=True`` lets the dispatcher run the Triton kernel (``fused_ops.rotary_embedding``: CUDA,
    or ``OSLO_FUSED_OPS=force`` under the interpreter); otherwise, and off CUDA, the same formula in torch.

    ``interleaved=True``: GPT-J's layout (``x * cos + rotate_every_two(x) * sin``, ``cos``/``sin`` from
    ``InterleavedRotaryEmbedding``). The Triton kernel rotates halves, so this layout always runs in torch."""
    if interleaved:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, d]: broadcast over the heads
        return query * cos + rotate_every_two(query) * sin, key * cos + rotate_every_two(key) * sin
    return fused_ops.rotary_embedding(query, key, cos, sin, enabled=fused)


def apply_partial_rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                         fused: bool = False, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` on the first ``cos.shape[-1]`` dims of each head of ``query [b, n_q, s, d]`` and ``key
    [b, n_kv, s, d]``; the other dims pass through (all of them rotate when ``cos`` is ``d`` wide)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == query.shape[-1]:
        return apply_rotary(query, key, cos, sin, fused=fused, interleaved=interleaved)
    query_rot, key_rot = apply_rotary(query[..., :rotary_dim].contiguous(), key[..., :rotary_dim].contiguous(),
                                      cos, sin, fused=fused, interleaved=interleaved)
    return (torch.cat([query_rot, query[..., rotary_dim:]], dim=-1),
            torch.cat([key_rot, key[..., rotary_dim:]], dim=-1))
