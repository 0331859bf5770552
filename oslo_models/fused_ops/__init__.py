"""Fused Triton ops with exact torch references.

Every public function takes ``enabled`` (models pass ``ParallelConfig.fused_ops``) and ``force_triton`` (tests);
``dispatch.use_triton`` decides: the Triton kernel on CUDA tensors when Triton imports, fused ops are enabled
and ``OSLO_FUSED_OPS`` is not ``0``; the plain-torch ``*_reference`` of the same function everywhere else.
Importing this package never needs Triton. Kernels are registered as ``torch.ops.oslo_models.*`` custom ops
(with fake and autograd registrations) so ``torch.compile`` traces through them.
"""
from oslo_models.fused_ops.bias_dropout_add import bias_dropout_add, bias_dropout_add_reference
from oslo_models.fused_ops.bias_gelu import bias_gelu, bias_gelu_reference
from oslo_models.fused_ops.cross_entropy import cross_entropy, cross_entropy_reference
from oslo_models.fused_ops.dispatch import ENV_VAR, env_enabled, triton_available, use_triton
from oslo_models.fused_ops.fused_linear_cross_entropy import (
                                                              fused_linear_cross_entropy,
                                                              fused_linear_cross_entropy_reference,
                                                              linear_cross_entropy_loss,
)
from oslo_models.fused_ops.layer_norm import FusedLayerNorm, layer_norm, layer_norm_reference
from oslo_models.fused_ops.rms_norm import FusedRMSNorm, rms_norm, rms_norm_reference
from oslo_models.fused_ops.rotary_embedding import rotary_embedding, rotary_embedding_reference
from oslo_models.fused_ops.softmax import softmax, softmax_reference

__all__ = [
    "ENV_VAR", "FusedLayerNorm", "FusedRMSNorm",
    "bias_dropout_add", "bias_dropout_add_reference", "bias_gelu", "bias_gelu_reference",
    "cross_entropy", "cross_entropy_reference", "env_enabled",
    "fused_linear_cross_entropy", "fused_linear_cross_entropy_reference",
    "layer_norm", "layer_norm_reference", "linear_cross_entropy_loss", "rms_norm", "rms_norm_reference",
    "rotary_embedding", "rotary_embedding_reference", "softmax", "softmax_reference",
    "triton_available", "use_triton",
]
