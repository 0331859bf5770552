"""The parallel plan of the Llama-family mixture-of-experts decoders (Mixtral, Qwen2-MoE): the Llama decoder's plan
(attention, dense MLPs, embeddings, head: ``models/llama/parallel_plan.py``) plus

- ``mlp.experts`` (``gate_up_proj``, ``down_proj``): stacked experts split over the expert-parallel group
  (``ExpertParallel``: contiguous blocks of ``E/ep`` experts; not split over tensor parallelism, see
  ``parallel_layers/moe/experts.py``);
- ``mlp.gate`` (router) and ``mlp.shared_expert_gate``: replicated;
- ``mlp.shared_expert`` (Qwen2-MoE): a SwiGLU MLP, column-/row-parallel like the dense one.

Gradient reduction follows from the same data (``distributed/expert_parallel.py``): tensors with
``ShardSpec.axis == "ep"`` over the expert-data-parallel group, the rest over data parallelism.
"""
from __future__ import annotations

from ...parallel_layers.moe import ExpertParallel
from ...parallel_layers.plan import Colwise, Rowwise
from ..llama.parallel_plan import decoder_plan

MOE_STYLES = {
    "layers.*.mlp.experts": ExpertParallel(),
    "layers.*.mlp.shared_expert.gate_proj": Colwise(),
    "layers.*.mlp.shared_expert.up_proj": Colwise(),
    "layers.*.mlp.shared_expert.down_proj": Rowwise(),
}


def moe_decoder_plan(prefix: str = "", **head_styles):
    styles = {(f"{prefix}.{pattern}" if prefix else pattern): style for pattern, style in MOE_STYLES.items()}
    return decoder_plan(prefix, **styles, **head_styles)


MOE_BASE_PLAN = moe_decoder_plan()
MOE_LM_PLAN = moe_decoder_plan("model", lm_head=Colwise(vocab=True))
