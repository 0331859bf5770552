"""Pieces shared by the encoder and encoder-decoder families (BERT, RoBERTa, T5): attention over this rank's
heads, T5-style feed-forwards, the RMS norm, sequence-parallel boundaries, vocab-parallel token losses and the
legacy (``LayerNorm.gamma/beta``) checkpoint key view."""
from .attention import attend, split_heads
from .lm_loss import causal_token_loss, full_logits, keep_last_logits, token_loss
from .mlp import DenseActDense, DenseGatedActDense
from .rms_norm import RMSNorm, SequenceParallelRMSNorm, SequenceParallelRMSNormStyle
from .sequence_parallel import enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel

__all__ = ["attend", "split_heads", "full_logits", "token_loss", "causal_token_loss", "keep_last_logits", "DenseActDense", "DenseGatedActDense", "RMSNorm",
           "SequenceParallelRMSNorm", "SequenceParallelRMSNormStyle", "enter_sequence_parallel",
           "leave_sequence_parallel", "use_sequence_parallel"]
