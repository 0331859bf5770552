"""Context parallelism: every sequence split over ``context_parallel_size`` ranks, attention across the chunks by
ring (``ring.py``), all-to-all (``all_to_all.py``) or both (``hybrid.py``: all-to-all inside groups, ring across),
one core for every family (``attention.py``).

- ``chunking.py``: which tokens each rank holds (mirrored chunks for the ring), split/merge of a batch;
- ``mask.py``: ``ContextParallelMask``, built once per forward, carried in place of the attention mask;
- ``loss.py``: the loss mean over the whole sequence, gradients that the dp x cp average sums;
- ``dropout.py``: attention-probability dropout whose keep bits are a hash of global coordinates;
- ``cross.py``: an encoder-decoder's encoder output gathered from the chunks for every decoder chunk's
  cross-attention (BART, T5);
- ``gathered.py``: the gathered-keys core for an additive pair bias (T5's relative position bias).
"""
from .all_to_all import all_to_all_attention, heads_to_sequence, sequence_to_heads
from .attention import attention_function, context_parallel_attention
from .chunking import check_sequence_length, merge_sequence, split_sequence, token_index
from .dropout import AttentionDropout, keep_mask
from .loss import context_num_items, sum_over_context, sum_over_replica_tokens, token_groups
from .mask import AlibiBias, ContextParallelMask, build_context_parallel_mask, with_alibi
from .ring import ring_attention

__all__ = ["AlibiBias", "AttentionDropout", "ContextParallelMask", "with_alibi", "keep_mask", "all_to_all_attention",
           "attention_function",
           "build_context_parallel_mask", "check_sequence_length", "context_num_items", "context_parallel_attention",
           "heads_to_sequence", "merge_sequence", "ring_attention", "sequence_to_heads", "split_sequence",
           "sum_over_context", "sum_over_replica_tokens", "token_groups", "token_index"]
