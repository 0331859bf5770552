"""Pieces shared by the families, on shelves: ``attention/`` (attention over this rank's heads and its variants, the
masks, the cache's name), ``feed_forward/`` (MLPs, mixture-of-experts blocks), ``embeddings/`` (rotary, learned
positions and ALiBi, vocab resizing), ``norms/`` (RMS and layer norms), ``stack/`` (the shared stack, its parts and
block templates, the encoders' stack, sequence/context-parallel boundaries, checkpointing, recorded outputs),
``loss/`` (vocab-parallel token losses, one rule per task head), ``pipeline/`` (the shared pipeline stages),
``loading/`` (checkpoint key views, ``from_pretrained`` options) and ``rules/`` (capabilities, divisibility rules,
the published plan). This package re-exports the components families name most."""
from .attention.attention import GroupedQueryAttention, attend, split_heads
from .attention.attention_variants import FullWidthQKNormAttention, PackedQKVAttention, SinkAttention
from .attention.causal_masks import causal_masks, layer_types
from .attention.packed_attention import HeadPackedAttention
from .embeddings.positions import LearnedPositionalEmbedding, alibi_slopes, build_alibi, local_alibi_slopes
from .embeddings.rotary import (
    InterleavedRotaryEmbedding,
    PartialRotaryEmbedding,
    PerLayerTypeRotary,
    RotaryEmbedding,
    apply_partial_rotary,
    apply_rotary,
)
from .feed_forward.mlp import DenseActDense, DenseGatedActDense, DenseMLP, GatedMLP, PackedGatedMLP
from .loading.renamed_keys import RenamedHubKeys
from .loss.lm_loss import causal_token_loss, full_logits, keep_last_logits, token_loss
from .norms.full_width_norm import FullWidthRMSNorm
from .norms.layer_norm import HeadLayerNormStyle, LayerNorm, ParameterFreeLayerNorm
from .norms.rms_norm import RMSNorm, SequenceParallelRMSNorm, SequenceParallelRMSNormStyle
from .stack.sequence_parallel import enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel

__all__ = ["attend", "split_heads", "full_logits", "token_loss", "causal_token_loss", "keep_last_logits",
           "DenseActDense", "DenseGatedActDense", "RMSNorm", "SequenceParallelRMSNorm", "SequenceParallelRMSNormStyle",
           "enter_sequence_parallel", "leave_sequence_parallel", "use_sequence_parallel",
           "GroupedQueryAttention", "PackedQKVAttention", "SinkAttention", "FullWidthQKNormAttention", "GatedMLP",
           "DenseMLP",
           "PackedGatedMLP", "FullWidthRMSNorm", "LayerNorm", "ParameterFreeLayerNorm", "RotaryEmbedding",
           "PartialRotaryEmbedding", "PerLayerTypeRotary", "apply_rotary", "LearnedPositionalEmbedding",
           "alibi_slopes", "local_alibi_slopes", "build_alibi", "causal_masks", "layer_types", "HeadPackedAttention",
           "HeadLayerNormStyle", "InterleavedRotaryEmbedding", "apply_partial_rotary", "RenamedHubKeys"]
