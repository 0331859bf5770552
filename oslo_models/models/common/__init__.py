"""Pieces shared by the families: attention over this rank's heads (and the grouped-query attention of the
Llama-shaped decoders, with its variants: sinks, full-width q/k norms; GPT-NeoX's per-head packed q|k|v),
feed-forwards (T5's, the SwiGLU ``GatedMLP``, ``DenseMLP``, Phi-3's ``PackedGatedMLP``), RMS and layer norms (and
the per-head layer norm style), rotary embeddings (full, partial, GPT-J's interleaved, one per attention type),
learned positions and ALiBi, per-layer causal masks, sequence-parallel boundaries, vocab-parallel token losses and
the checkpoint key views (legacy ``LayerNorm.gamma/beta``; keys ``transformers`` renames, GPT-NeoX's
``embed_out``)."""
from .attention import GroupedQueryAttention, attend, split_heads
from .attention_variants import FullWidthQKNormAttention, PackedQKVAttention, SinkAttention
from .causal_masks import causal_masks, layer_types
from .full_width_norm import FullWidthRMSNorm
from .layer_norm import HeadLayerNormStyle, LayerNorm, ParameterFreeLayerNorm
from .lm_loss import causal_token_loss, full_logits, keep_last_logits, token_loss
from .mlp import DenseActDense, DenseGatedActDense, DenseMLP, GatedMLP, PackedGatedMLP
from .packed_attention import HeadPackedAttention
from .positions import LearnedPositionalEmbedding, alibi_slopes, build_alibi, local_alibi_slopes
from .renamed_keys import RenamedHubKeys
from .rms_norm import RMSNorm, SequenceParallelRMSNorm, SequenceParallelRMSNormStyle
from .rotary import (
    InterleavedRotaryEmbedding,
    PartialRotaryEmbedding,
    PerLayerTypeRotary,
    RotaryEmbedding,
    apply_partial_rotary,
    apply_rotary,
)
from .sequence_parallel import enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel

__all__ = ["attend", "split_heads", "full_logits", "token_loss", "causal_token_loss", "keep_last_logits",
           "DenseActDense", "DenseGatedActDense", "RMSNorm", "SequenceParallelRMSNorm", "SequenceParallelRMSNormStyle",
           "enter_sequence_parallel", "leave_sequence_parallel", "use_sequence_parallel",
           "GroupedQueryAttention", "PackedQKVAttention", "SinkAttention", "FullWidthQKNormAttention", "GatedMLP",
           "DenseMLP",
           "PackedGatedMLP", "FullWidthRMSNorm", "LayerNorm", "ParameterFreeLayerNorm", "RotaryEmbedding",
           "PartialRotaryEmbedding", "PerLayerTypeRotary", "apply_rotary", "LearnedPositionalEmbedding",
           "alibi_slopes", "local_alibi_slopes", "build_alibi", "causal_masks", "layer_types", "HeadPackedAttention",
           "HeadLayerNormStyle", "InterleavedRotaryEmbedding", "apply_partial_rotary", "RenamedHubKeys"]
