"""``OSLO_FUSED_OPS=force`` runs the Triton kernels wherever fused ops are enabled, and never where the config
(``enabled=False``, ``ParallelConfig.fused_ops=False``) turned them off: for every public op and module, which
kernels ran is observed with a dispatch mode (``tests.helpers.ops.OpsSeen``)."""
from __future__ import annotations

import pytest
import torch

from oslo_models import fused_ops
from oslo_models.fused_ops import dispatch
from tests.fused_ops.checks import requires_interpreter
from tests.helpers.ops import OpsSeen


class _FakeCuda:
    is_cuda = True


def _calls():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 8, generator=gen), torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    q, k = torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    cos, sin = torch.randn(1, 5, 8, generator=gen), torch.randn(1, 5, 8, generator=gen)
    labels = torch.randint(0, 8, (6,), generator=gen)
    return {
        "layer_norm": lambda on: fused_ops.layer_norm(x, w, b, enabled=on),
        "rms_norm": lambda on: fused_ops.rms_norm(x, w, enabled=on),
        "bias_gelu": lambda on: fused_ops.bias_gelu(x, b, enabled=on),
        "bias_dropout_add": lambda on: fused_ops.bias_dropout_add(x, b, x, 0.1, enabled=on),
        "softmax": lambda on: fused_ops.softmax(q, causal=True, enabled=on),
        "rotary_embedding": lambda on: fused_ops.rotary_embedding(q, k, cos, sin, enabled=on),
        "cross_entropy": lambda on: fused_ops.cross_entropy(x, labels, label_smoothing=0.1, enabled=on),
        "fused_linear_cross_entropy": lambda on: fused_ops.fused_linear_cross_entropy(x, torch.randn(8, 8), labels,
                                                                                     enabled=on),
        "FusedLayerNorm": lambda on: fused_ops.FusedLayerNorm(8, fused_ops=on)(x),
        "FusedRMSNorm": lambda on: fused_ops.FusedRMSNorm(8, fused_ops=on)(x),
    }


@pytest.mark.parametrize("value", ["force", "FORCE", " force "])
def test_force_never_enables_a_disabled_kernel_in_the_rule(monkeypatch, value):
    monkeypatch.setenv(dispatch.ENV_VAR, value)
    assert not dispatch.use_triton(_FakeCuda(), enabled=False)
    assert not dispatch.use_triton(torch.zeros(2), enabled=False)  # and no "needs TRITON_INTERPRET" error either


@pytest.mark.parametrize("name", sorted(_calls()))
def test_force_runs_no_kernel_where_the_config_disabled_it(monkeypatch, name):
    monkeypatch.setenv(dispatch.ENV_VAR, "force")
    call = _calls()[name]
    with OpsSeen() as seen:
        call(False)
    assert seen.named("oslo_models") == [], f"{name}(enabled=False) ran a kernel under OSLO_FUSED_OPS=force"


@requires_interpreter
@pytest.mark.parametrize("name", sorted(_calls()))
def test_force_runs_the_kernel_where_enabled(monkeypatch, name):
    # The positive control: the same calls with fused ops enabled do reach the kernels (so the check above can see
    # them).
    monkeypatch.setenv(dispatch.ENV_VAR, "force")
    with OpsSeen() as seen:
        call = _calls()[name]
        call(True)
    assert seen.named("oslo_models"), f"{name}(enabled=True) ran no kernel under OSLO_FUSED_OPS=force"
