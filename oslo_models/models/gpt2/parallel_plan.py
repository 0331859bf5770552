"""GPT-2's parallel plan is derived from ``GPT2_SPEC`` (``modeling_gpt2.py``): ``GPT2Attention`` carries ``c_attn``
split per packed q|k|v block (``Colwise(num_packed=3)``: rank r keeps heads ``r*n/tp ..`` of q, of k and of v,
never "the first third of the columns") and ``c_proj`` row-parallel; ``GPT2MLP`` ``c_fc`` column-, ``c_proj``
row-parallel; the norms are sequence-parallel aware; residual dropouts draw per-rank masks under sequence
parallelism, attention dropout always draws from the tensor-parallel stream (it acts on this rank's heads); the stack
adds the vocab-parallel ``wte``, the replicated ``wpe`` and ``drop``; the LM head is vocab-parallel.

``published_tp_plan`` is what ``GPT2Config.base_model_tp_plan`` publishes, from the same spec."""
from __future__ import annotations

from ..common.rules.published_plan import PublishedTPPlan


def published_tp_plan() -> PublishedTPPlan:
    return PublishedTPPlan("oslo_models.models.gpt2.modeling_gpt2", "GPT2_SPEC")
