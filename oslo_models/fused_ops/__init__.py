"""Fused Triton ops with exact torch references (see ``dispatch.py`` for when each path runs)."""
from oslo_models.fused_ops.dispatch import env_enabled, triton_available, use_triton
from oslo_models.fused_ops.layer_norm import FusedLayerNorm, layer_norm, layer_norm_reference
from oslo_models.fused_ops.rms_norm import FusedRMSNorm, rms_norm, rms_norm_reference
from oslo_models.fused_ops.softmax import softmax, softmax_reference
from oslo_models.fused_ops.bias_gelu import bias_gelu, bias_gelu_reference
from oslo_models.fused_ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from oslo_models.fused_ops.rotary_embedding import rotary_embedding, rotary_embedding_reference
from oslo_models.fused_ops.cross_entropy import cross_entropy, cross_entropy_reference
from oslo_models.fused_ops.fused_linear_cross_entropy import (
    fused_linear_cross_entropy, fused_linear_cross_entropy_reference)

__all__ = [
    "FusedLayerNorm", "env_enabled", "layer_norm", "layer_norm_reference", "triton_available", "use_triton",
]
