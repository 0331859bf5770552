"""Multi-head attention over this rank's heads, through ``transformers``' attention interface.

Families keep their own projection modules (BERT's ``query/key/value``, T5's ``q/k/v/o``: the names are the
state-dict contract) and call these helpers between the projections; the Llama-shaped decoders (Llama, Mistral,
Qwen2, Qwen3, and the MoE decoders built on them) share ``GroupedQueryAttention`` whole. Under tensor
parallelism the q/k/v projections are column-parallel, so their outputs hold ``n/tp`` whole heads and attention
runs on those heads with no communication; the output projection is row-parallel and does the reduction.

Shapes: b batch, s sequence (always the full sequence here: column-parallel layers gather it under sequence
parallelism), n heads (n/tp on this rank), d head dim.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager_attention

from ....parallel_layers.context_parallel import ContextParallelMask, attention_function
from ....parallel_layers.kv_heads import HeadsLinear, KVHeadColwise
from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..embeddings.rotary import apply_partial_rotary
from ..norms.rms_norm import RMSNorm, SequenceParallelRMSNormStyle
from ..rules.parallel_rules import Heads, KeyValueHeads
from ..stack.fused_kernels import FusedKernels


def num_key_value_heads(config) -> int:
    """The config's key/value heads; a config without the attribute (GPT-J, GPT-NeoX) is multi-head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[b, s, (n/tp)*d]`` -> ``[b, n/tp, s, d]``."""
    return x.view(*x.shape[:-1], -1, head_dim).transpose(1, 2)


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, *, dropout,
           scaling: float, eager_fallback, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [b, n/tp, s_q, d]`` over ``key, value [b, n/tp, s_k, d]``; returns
    ``([b, s_q, (n/tp)*d], weights)``.

    ``module.config._attn_implementation`` picks the kernel (SDPA by default, ``eager_fallback`` for "eager").
    ``dropout`` is the attention-probability dropout module: under TP it draws from the tensor-parallel RNG
    stream, because each rank drops elements of different heads. Extra ``kwargs`` (e.g. T5's ``position_bias``)
    go to the kernel. A ``ContextParallelMask`` as ``attention_mask`` runs the context-parallel core instead
    (``parallel_layers/context_parallel``; ``s_q``/``s_k`` are then this rank's chunks).
    """
    interface = attention_function(module, attention_mask, eager_fallback)  # context-parallel for its mask

    def core(query, key, value):
        with dropout.rng_context():
            return interface(module, query, key, value, attention_mask,
                             dropout=dropout.p if module.training else 0.0, scaling=scaling, **kwargs)

    checkpoint = getattr(module, "core_checkpoint", None)
    if checkpoint is not None and module.training and torch.is_grad_enabled():
        out, weights = checkpoint(core, query, key, value)  # selective recomputation (common/stack/checkpointing.py)
    else:
        out, weights = core(query, key, value)
    return out.reshape(*out.shape[:-2], -1).contiguous(), weights


def refuse_context_parallel(attention_mask, what: str) -> None:
    """The context-parallel core (ring / all-to-all) runs plain softmax attention: ``NotImplementedError`` for an
    option it would silently drop."""
    if isinstance(attention_mask, ContextParallelMask):
        raise NotImplementedError(f"{what} under context parallelism is not implemented: the ring / all-to-all core "
                                  "merges plain softmax blocks and has no place for it inside each block")


class AttentionModule(nn.Module):
    """Base of every family's attention module that runs its kernel through ``attend``. ``core_checkpoint`` is the
    activation-checkpoint function of the ``"selective"`` mode (set by ``apply_activation_checkpointing``; ``None``:
    the attention core keeps its activations)."""

    core_checkpoint = None
    #: the kernels this attention runs, as ``transformers``' class flags name them (``_supports_<kernel>``); the
    #: classes of a family built from a spec take their flags from its attention component (``heads.
    #: StackFamilyModel``; a spec's ``kernels`` overrides it where a switch rules a kernel out: Gemma 2's soft-cap)
    kernels = frozenset({"sdpa", "flash_attn", "flex_attn", "attention_backend"})


class GroupedQueryAttention(FusedKernels, AttentionModule):
    """Causal self-attention with rotary positions and grouped-query heads: the Llama / Mistral / Qwen2 / Qwen3
    attention (module names and keys ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` and Qwen3's ``q_norm``,
    ``k_norm``), written single-device.

    Switches: ``qkv_bias`` / ``o_bias`` (Llama's ``attention_bias``, Qwen2's q/k/v biases), ``qk_norm`` (Qwen3's RMS
    norms over ``head_dim``, before rotary; a formula name instead of ``True`` picks it, Gemma 3: ``"gemma"``),
    ``sliding_window`` (this layer's window, or ``None``; the mask does the windowing, the value is passed on for
    kernels that take it); ``fused`` (the Triton rotary kernel) is set when the model is built
    (``common/stack/fused_kernels.py``). Off by default, for the other Hub decoders:

    - ``scaling``: the score scale instead of ``head_dim ** -0.5`` (Gemma: ``query_pre_attn_scalar ** -0.5``);
    - ``softcap``: logit soft-capping ``c * tanh(scores / c)`` before the mask (Gemma 2 ``attn_logit_softcapping``),
      passed as the attention interface's ``softcap=`` (eager: ``transformers``' Gemma 2 ``eager_attention_forward``;
      SDPA refuses it, as in ``transformers``; the context-parallel cores cap inside each block);
    - partial rotary needs no switch: rotary acts on the first ``cos.shape[-1]`` dims of each head and passes the
      rest through (``transformers``' GPT-NeoX/Phi rule), so a ``PartialRotaryEmbedding`` (``partial_rotary_factor``)
      makes it partial. Learned sinks (gpt-oss) and full-width q/k norms (OLMo 2): ``attention_variants.py``;
    - ``interleaved_rotary``: GPT-J's pairwise rotation (``InterleavedRotaryEmbedding``'s ``cos``/``sin``);
    - ``out_name``: the output projection's attribute (a class attribute: Phi ``dense``, GPT-J ``out_proj``; the
      subclass states its ``tp_plan`` under that name). Configs without ``num_key_value_heads`` (GPT-J) are
      multi-head: as many key/value heads as query heads.

    Under tensor parallelism the plan makes ``q_proj`` column-parallel (``n/tp`` query heads per rank), ``k_proj``/
    ``v_proj`` key/value-head-parallel (``parallel_layers/kv_heads.py``: ``n_kv/tp`` heads, or one replicated head
    when ``tp > n_kv``) and ``o_proj`` row-parallel (its all-reduce / reduce-scatter is the only forward
    collective). ``num_key_value_groups`` is read from the local projections, so the attention kernels repeat
    this rank's key/value heads for this rank's query heads.

    Shapes: input ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism), ``cos``/``sin`` ``[b, s, d]``;
    output like the input.
    """

    # the plan fragment: q by heads, k/v by key/value heads (replicated when tp > n_kv), o by rows; Qwen3's q/k
    # norms act on this rank's heads, so their gradients are always summed over TP
    tp_plan = {"q_proj": Colwise(), "k_proj": KVHeadColwise(), "v_proj": KVHeadColwise(),
               "q_norm": SequenceParallelRMSNormStyle(always_reduce=True),
               "k_norm": SequenceParallelRMSNormStyle(always_reduce=True),
               "o_proj": Rowwise(), "attn_dropout": TPDropout(always_split=True)}

    #: the output projection's attribute (``transformers``' name: Llama ``o_proj``, Phi ``dense``, GPT-J ``out_proj``)
    out_name = "o_proj"

    @classmethod
    def parallel_rules(cls, config) -> list:
        heads, kv_heads = config.num_attention_heads, num_key_value_heads(config)
        return [Heads("num_attention_heads", heads), KeyValueHeads("num_key_value_heads", kv_heads, heads)]

    def __init__(self, config, layer_idx: int, *, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool | str = False, sliding_window: int | None = None, eager_fallback=None,
                 scaling: float | None = None, softcap: float | None = None, interleaved_rotary: bool = False):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_heads, num_kv = config.num_attention_heads, num_key_value_heads(config)
        self.scaling = self.head_dim ** -0.5 if scaling is None else scaling
        self.softcap = softcap
        self.is_causal = True
        self.sliding_window, self.interleaved_rotary = sliding_window, interleaved_rotary
        self.build_projections(config.hidden_size, num_heads, num_kv, qkv_bias=qkv_bias, o_bias=o_bias)
        if qk_norm:  # True: Qwen3's (the "llama" formula); a formula name: that one (Gemma 3: "gemma")
            formula = qk_norm if isinstance(qk_norm, str) else "llama"
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, formula=formula)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps, formula=formula)
        self.attn_dropout = Dropout(getattr(config, "attention_dropout", 0.0) or 0.0)
        if eager_fallback is None and softcap is not None:  # Gemma 2's eager kernel soft-caps
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as eager_fallback
        self._eager_fallback = eager_fallback or llama_eager_attention

    def build_projections(self, hidden_size: int, num_heads: int, num_kv: int, *, qkv_bias: bool, o_bias: bool):
        """The q/k/v/o projections, registered in ``transformers``' order (a variant with other projection modules,
        e.g. Phi-3's fused ``qkv_proj``, overrides this with ``project`` and ``num_key_value_groups``)."""
        self.q_proj = Linear(hidden_size, num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = HeadsLinear(hidden_size, num_kv * self.head_dim, num_heads=num_kv, bias=qkv_bias)
        self.v_proj = HeadsLinear(hidden_size, num_kv * self.head_dim, num_heads=num_kv, bias=qkv_bias)
        self.add_module(self.out_name, Linear(num_heads * self.head_dim, hidden_size, bias=o_bias))

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head on this rank (what the attention kernels repeat key/value by)."""
        return self.q_proj.out_features // self.k_proj.out_features

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query [b, n/tp, s, d]``, ``key``/``value [b, n_kv/tp, s, d]`` before rotary (q/k norms applied)."""
        query = split_heads(self.q_proj(hidden_states), self.head_dim)  # [b, n/tp, s, d]
        key = split_heads(self.k_proj(hidden_states), self.head_dim)  # [b, n_kv/tp, s, d]
        value = split_heads(self.v_proj(hidden_states), self.head_dim)
        if hasattr(self, "q_norm"):
            query, key = self.q_norm(query), self.k_norm(key)
        return query, key, value

    def rotate(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotary on the first ``cos.shape[-1]`` dims of each head (all of them unless the rotary is partial)."""
        return apply_partial_rotary(query, key, cos, sin, fused=self.fused, interleaved=self.interleaved_rotary)

    def kernel_kwargs(self, attention_mask) -> dict:
        """Extra keyword arguments of the attention kernel (``softcap``; the sinks of ``SinkAttention``)."""
        if self.softcap is None:
            return {}
        return {"softcap": self.softcap}  # every core caps: eager, flex, flash, the context-parallel ring/all-to-all

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask=None, past_key_values=None, **kwargs):
        query, key, value = self.project(hidden_states)
        cos, sin = position_embeddings
        query, key = self.rotate(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,
                              scaling=self.scaling, eager_fallback=self._eager_fallback,
                              sliding_window=self.sliding_window, **self.kernel_kwargs(attention_mask), **kwargs)
        return getattr(self, self.out_name)(out), weights
