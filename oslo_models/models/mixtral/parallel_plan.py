"""The parallel plan of the Llama-family mixture-of-experts decoders (Mixtral, Qwen2-MoE) is derived from
``MOE_SPEC`` (``modeling_mixtral.py``): the Llama decoder's components, with ``SparseMoeBlock`` carrying its fragment

- ``mlp.experts`` (``gate_up_proj``, ``down_proj``): stacked experts split over the expert-parallel group
  (``ExpertParallel``: contiguous blocks of ``E/ep`` experts; each expert split over
  ``expert_tensor_parallel_size`` tp ranks, see ``parallel_layers/moe/experts.py``);
- ``mlp.gate`` (router) and ``mlp.shared_expert_gate``: replicated;
- ``mlp.shared_expert`` (Qwen2-MoE): a SwiGLU MLP, column-/row-parallel like the dense one.

Gradient reduction follows from the same data (``distributed/expert_parallel.py``): tensors with
layouts whose ``axis`` is ``"ep"`` over the expert-data-parallel group, the rest over data parallelism.
"""
from __future__ import annotations

from ..common.rules.published_plan import PublishedTPPlan


def published_tp_plan() -> PublishedTPPlan:
    return PublishedTPPlan("oslo_models.models.mixtral.modeling_mixtral", "MOE_SPEC",
                           drop=("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm"))
