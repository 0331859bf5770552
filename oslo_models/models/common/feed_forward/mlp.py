"""Feed-forward blocks: T5-style (``transformers``' ``T5DenseActDense`` / ``T5DenseGatedActDense``, the same
modules mT5, UMT5 and LongT5 use), the Llama family's SwiGLU ``GatedMLP`` (any activation: Gemma's
``gelu_pytorch_tanh`` too), the two-layer ``DenseMLP`` of the GPT-J / GPT-NeoX / OPT / Bloom / Phi / Falcon
decoders (names, biases, activation and layout per family) and Phi-3's ``PackedGatedMLP`` (one ``gate_up_proj``),
written with plain layers for a Megatron split.

``wi`` (and ``wi_0``/``wi_1``) are column-parallel: input ``[b, s, d_model]`` (``[b, s/tp, d_model]`` under
sequence parallelism, read from the context's region: each gathers the sequence), output ``[b, s, d_ff/tp]``. ``wo`` is
row-parallel: it all-reduces (or reduce-scatters) back to ``d_model``. The dropout between them acts on TP-split
activations.
"""
from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN

from ....parallel_layers.layers import Dropout, Linear
from ....parallel_layers.plan import Colwise, Rowwise, TPDropout
from ..rules.parallel_rules import Features
from .bias_act import fused_gelu_approximation, linear_act


class _T5FeedForward(nn.Module):
    """What T5's two feed-forwards share: the column-parallel ``inputs`` (no bias; the first one activated, fused
    with its GELU when enabled), the row-parallel ``wo`` and the dropout between; ``inner`` is the variant's."""

    inputs: tuple[str, ...] = ()

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("d_ff", config.d_ff)]

    def __init__(self, d_model: int, d_ff: int, *, act: str, dropout: float):
        super().__init__()
        for name in self.inputs:
            self.add_module(name, Linear(d_model, d_ff, bias=False))
        self.wo = Linear(d_ff, d_model, bias=False)
        self.dropout = Dropout(dropout)
        self.act_name, self.act = act, ACT2FN[act]
        self.fused_gelu = None  # bias_gelu's ``approximate`` for GELU variants when fused (configure_fused_ops)

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused_gelu = fused_gelu_approximation(enabled, self.act_name, getattr(self, self.inputs[0]))

    def activated(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``act(first input(x))``: ``[b, s, d] -> [b, s, d_ff/tp]``."""
        return linear_act(getattr(self, self.inputs[0]), self.act, hidden_states, approximate=self.fused_gelu)

    def inner(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dropout(self.inner(hidden_states))  # [b, s, d_ff/tp]
        # the cast keeps a fp32 ``wo`` (Flan-T5 in 8-bit setups) working, as transformers does
        return self.wo(hidden_states.to(self.wo.weight.dtype))


class DenseActDense(_T5FeedForward):
    """``wo(dropout(act(wi(x))))`` (original T5: ReLU)."""

    tp_plan = {"wi": Colwise(), "wo": Rowwise(), "dropout": TPDropout(always_split=True)}
    inputs = ("wi",)

    def inner(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activated(hidden_states)


class DenseGatedActDense(_T5FeedForward):
    """``wo(dropout(act(wi_0(x)) * wi_1(x)))`` (T5 v1.1 / Flan-T5: gated GELU). Each rank gates its own
    ``d_ff/tp`` columns of both branches, so the product needs no communication."""

    tp_plan = {"wi_0": Colwise(), "wi_1": Colwise(), "wo": Rowwise(), "dropout": TPDropout(always_split=True)}
    inputs = ("wi_0", "wi_1")

    def inner(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.activated(hidden_states) * self.wi_1(hidden_states)


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``: the SwiGLU feed-forward of Llama, Mistral, Qwen2 and Qwen3
    (``LlamaMLP``; module names and keys as there), and the expert of the MoE decoders built on them.

    ``gate_proj``/``up_proj`` column-parallel (each rank gates its own ``intermediate/tp`` columns of both, no
    communication), ``down_proj`` row-parallel (all-reduce, or reduce-scatter under sequence parallelism).
    Input/output ``[b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism).
    """

    tp_plan = {"gate_proj": Colwise(), "up_proj": Colwise(), "down_proj": Rowwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("intermediate_size", config.intermediate_size)]

    def __init__(self, hidden_size: int, intermediate_size: int, *, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate = self.act_fn(self.gate_proj(hidden_states))  # [b, s, i/tp]
        return self.down_proj(gate * self.up_proj(hidden_states))


class DenseMLP(nn.Module):
    """``down(act(up(x)))``, then an optional residual dropout: the two-layer feed-forward of GPT-J (``fc_in``/
    ``fc_out``), GPT-NeoX and Bloom (``dense_h_to_4h``/``dense_4h_to_h``), OPT-style ``fc1``/``fc2`` (the default),
    Phi (``fc1``/``fc2``), Falcon, GPT-2 (``c_fc``/``c_proj``, ``layout="conv1d"``).

    A family names its modules by subclassing: ``class GPTNeoXMLP(DenseMLP): names = ("dense_h_to_4h",
    "dense_4h_to_h")``; the plan fragment follows the names (``__init_subclass__``). ``intermediate_attr``: the
    config attribute of the inner width, for the divisibility rule (unset or ``None`` in the config: ``4 * h``).
    ``act``: an ``ACT2FN`` name or a callable (a GELU name runs the fused bias-GELU where ``fused_ops`` allows:
    ``common/feed_forward/bias_act.py``). ``dropout``: applied to the output (the residual stream).

    ``up`` column-parallel (``[b, s, h]`` / ``[b, s/tp, h]`` -> ``[b, s, i/tp]``, gathering the sequence under
    sequence parallelism), ``down`` row-parallel (all-reduce, or reduce-scatter under sequence parallelism).
    """

    names: tuple[str, str] = ("fc1", "fc2")
    intermediate_attr: str = "intermediate_size"
    tp_plan = {"fc1": Colwise(), "fc2": Rowwise(), "dropout": TPDropout()}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        up, down = cls.names
        cls.tp_plan = {up: Colwise(), down: Rowwise(), "dropout": TPDropout()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        inner = getattr(config, cls.intermediate_attr, None) or 4 * config.hidden_size
        return [Features(cls.intermediate_attr, inner)]

    def __init__(self, hidden_size: int, intermediate_size: int, *, act="gelu_new", bias: bool = True,
                 dropout: float = 0.0, layout: str = "linear"):
        super().__init__()
        up, down = self.names
        self.add_module(up, Linear(hidden_size, intermediate_size, bias=bias, layout=layout))
        self.add_module(down, Linear(intermediate_size, hidden_size, bias=bias, layout=layout))
        self.act_name = act
        self.act = ACT2FN[act] if isinstance(act, str) else act
        self.dropout = Dropout(dropout)
        self.fused_gelu = None  # bias_gelu's ``approximate`` when the fused bias-GELU runs (configure_fused_ops)

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused_gelu = fused_gelu_approximation(enabled, self.act_name, getattr(self, self.names[0]))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        up, down = (getattr(self, name) for name in self.names)
        inner = linear_act(up, self.act, hidden_states, approximate=self.fused_gelu)  # [b, s, i/tp]
        return self.dropout(down(inner))


class PackedGatedMLP(nn.Module):
    """Phi-3's ``down_proj(up * act(gate))`` with ``gate_up_proj`` one ``[2i, h]`` linear holding ``gate | up``
    (``Phi3MLP``; keys as there).

    ``gate_up_proj`` is column-parallel with two packed blocks (``Colwise(num_packed=2)``): rank ``r`` holds rows
    ``r`` of each of gate and up, so its local output ``[b, s, 2i/tp]`` is ``gate_r | up_r`` and splits in two
    locally with no communication. ``down_proj`` row-parallel (all-reduce / reduce-scatter).
    """

    tp_plan = {"gate_up_proj": Colwise(num_packed=2), "down_proj": Rowwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("intermediate_size", config.intermediate_size)]

    def __init__(self, hidden_size: int, intermediate_size: int, *, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.activation_fn = ACT2FN[act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)  # each [b, s, i/tp]
        return self.down_proj(up * self.activation_fn(gate))
