"""Pieces shared by the families: attention over this rank's heads (and the grouped-query attention of the
Llama-shaped decoders), feed-forwards (T5's, the SwiGLU ``GatedMLP``), RMS norms, rotary embeddings, per-layer
causal masks, sequence-parallel boundaries, vocab-parallel token losses and the legacy
(``LayerNorm.gamma/beta``) checkpoint key view."""
from .attention import GroupedQueryAttention, attend, split_heads
from .causal_masks import causal_masks, layer_types
from .lm_loss import causal_token_loss, full_logits, keep_last_logits, token_loss
from .mlp import DenseActDense, DenseGatedActDense, GatedMLP
from .rms_norm import RMSNorm, SequenceParallelRMSNorm, SequenceParallelRMSNormStyle
from .rotary import RotaryEmbedding, apply_rotary
from .sequence_parallel import enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel

__all__ = ["attend", "split_heads", "full_logits", "token_loss", "causal_token_loss", "keep_last_logits", "DenseActDense", "DenseGatedActDense", "RMSNorm",
           "SequenceParallelRMSNorm", "SequenceParallelRMSNormStyle", "enter_sequence_parallel",
           "leave_sequence_parallel", "use_sequence_parallel",
           "GroupedQueryAttention", "GatedMLP", "RotaryEmbedding", "apply_rotary", "causal_masks", "layer_types"]
