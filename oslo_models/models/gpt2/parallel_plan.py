"""GPT-2's parallel plan: the one place that says how each GPT-2 module is split over tensor-parallel ranks.

GPT-2 stores its projections as ``Conv1D`` (weight ``[in, out]``). ``c_attn`` packs q|k|v along the output, so
it is split per block (``num_packed=3``): rank r keeps heads ``r*n/tp .. (r+1)*n/tp`` of q, of k and of v, never
"the first third of the columns" (which would be all of q on rank 0).

Sequence parallelism: the norms get ``SequenceParallelNorm`` (their grads are summed over TP ranks when each
rank saw only its slice of the tokens); residual dropouts draw per-rank masks under SP; attention dropout acts
on this rank's heads and always draws from the tensor-parallel stream.
"""
from __future__ import annotations

from ...parallel_layers.plan import (
    Colwise,
    ParallelPlan,
    PositionEmbedding,
    Rowwise,
    SequenceParallelNorm,
    TPDropout,
    VocabEmbedding,
)

_BASE_STYLES = {
    "wte": VocabEmbedding(),
    "wpe": PositionEmbedding(),
    "drop": TPDropout(),
    "h.*.ln_1": SequenceParallelNorm(),
    "h.*.attn.c_attn": Colwise(num_packed=3),
    "h.*.attn.c_proj": Rowwise(),
    "h.*.attn.attn_dropout": TPDropout(always_split=True),
    "h.*.attn.resid_dropout": TPDropout(),
    "h.*.ln_2": SequenceParallelNorm(),
    "h.*.mlp.c_fc": Colwise(),
    "h.*.mlp.c_proj": Rowwise(),
    "h.*.mlp.dropout": TPDropout(),
    "ln_f": SequenceParallelNorm(),
}

GPT2_BASE_PLAN = ParallelPlan(_BASE_STYLES)
GPT2_LM_PLAN = ParallelPlan({**{f"transformer.{k}": v for k, v in _BASE_STYLES.items()},
                             "lm_head": Colwise(vocab=True)})
GPT2_HEAD_PLAN = ParallelPlan({f"transformer.{k}": v for k, v in _BASE_STYLES.items()})  # replicated heads
