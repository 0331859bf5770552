"""The parallel plan of the Llama-shaped decoders (Llama, Mistral, Qwen2, Qwen3): the one place that says how each
of their modules is split over tensor-parallel ranks. The four share module names, so they share the plan; a
pattern a model lacks (``q_norm``/``k_norm`` outside Qwen3, biases outside Qwen2) simply matches nothing.

- ``q_proj`` column-parallel: rank r owns query heads ``r*n/tp .. (r+1)*n/tp``;
- ``k_proj``/``v_proj`` key/value-head-parallel (``KVHeadColwise``): ``n_kv/tp`` whole heads per rank, or, when
  ``tp > n_kv``, one head replicated on ``tp/n_kv`` consecutive ranks (the head rank r's query heads use), with
  the copies' gradients summed; checkpoints keep exactly the original ``[n_kv*d, h]`` tensors;
- ``o_proj`` row-parallel; ``gate_proj``/``up_proj`` column-parallel, ``down_proj`` row-parallel;
- ``embed_tokens`` and ``lm_head`` vocab-parallel (the vocabulary is padded to a multiple of tp on the ranks only);
- the residual-stream RMS norms are sequence-parallel aware; Qwen3's ``q_norm``/``k_norm`` act on this rank's
  heads, so their gradients are always summed over TP (``replicated_with_grad_allreduce`` in ``transformers``);
- classification heads (``score``, ``qa_outputs``) are replicated.
"""
from __future__ import annotations

from ...parallel_layers.kv_heads import KVHeadColwise
from ...parallel_layers.plan import Colwise, ParallelPlan, Rowwise, TPDropout, VocabEmbedding
from ..common import SequenceParallelRMSNormStyle

QK_NORMS = ("layers.*.self_attn.q_norm", "layers.*.self_attn.k_norm")

DECODER_STYLES = {
    "embed_tokens": VocabEmbedding(),
    "layers.*.input_layernorm": SequenceParallelRMSNormStyle(),
    "layers.*.self_attn.q_proj": Colwise(),
    "layers.*.self_attn.k_proj": KVHeadColwise(),
    "layers.*.self_attn.v_proj": KVHeadColwise(),
    **{pattern: SequenceParallelRMSNormStyle(always_reduce=True) for pattern in QK_NORMS},
    "layers.*.self_attn.o_proj": Rowwise(),
    "layers.*.self_attn.attn_dropout": TPDropout(always_split=True),
    "layers.*.post_attention_layernorm": SequenceParallelRMSNormStyle(),
    "layers.*.mlp.gate_proj": Colwise(),
    "layers.*.mlp.up_proj": Colwise(),
    "layers.*.mlp.down_proj": Rowwise(),
    "norm": SequenceParallelRMSNormStyle(),
}


def decoder_plan(prefix: str = "", **head_styles) -> ParallelPlan:
    """The decoder's plan with its module names under ``prefix`` (``"model"``; Llama's QA head: ``"transformer"``),
    plus the head modules' styles (``lm_head=Colwise(vocab=True)``)."""
    styles = {(f"{prefix}.{pattern}" if prefix else pattern): style for pattern, style in DECODER_STYLES.items()}
    return ParallelPlan({**styles, **head_styles})


def published_tp_plan(qk_norm: bool = False) -> dict[str, str]:
    """``base_model_tp_plan`` in ``transformers``' vocabulary, for a config class (Qwen3's lists the q/k norms)."""
    plan = decoder_plan().hf_tp_plan()
    return {pattern: style for pattern, style in plan.items() if qk_norm or pattern not in QK_NORMS}


LLAMA_BASE_PLAN = decoder_plan()
LLAMA_LM_PLAN = decoder_plan("model", lm_head=Colwise(vocab=True))
LLAMA_HEAD_PLAN = decoder_plan("model")  # sequence / token classification: replicated heads
LLAMA_QA_PLAN = decoder_plan("transformer")  # LlamaForQuestionAnswering keeps its base model under "transformer"
