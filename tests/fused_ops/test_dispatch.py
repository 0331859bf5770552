import importlib
import subprocess
import sys

import pytest
import torch

from oslo_models import fused_ops
from oslo_models.fused_ops import dispatch
from tests.fused_ops.checks import requires_interpreter

CPU = torch.zeros(2, 3)


class _FakeCuda:
    """Stands in for a CUDA tensor in the pure decision function (it only reads ``is_cuda``)."""
    is_cuda = True


def test_cpu_tensors_take_the_reference():
    assert not dispatch.use_triton(CPU)
    assert not dispatch.use_triton(CPU, None, enabled=True)


def test_cuda_tensors_take_triton_unless_disabled(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.use_triton(_FakeCuda(), None) == dispatch.triton_available()
    assert not dispatch.use_triton(_FakeCuda(), enabled=False)
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv(dispatch.ENV_VAR, off)
        assert not dispatch.env_enabled()
        assert not dispatch.use_triton(_FakeCuda())
    monkeypatch.setenv(dispatch.ENV_VAR, "1")
    assert dispatch.use_triton(_FakeCuda()) == dispatch.triton_available()


def test_compiled_code_takes_the_reference_unless_forced(monkeypatch):
    """Under torch.compile the references let Inductor fuse (GPT-2 350M, H200: 1.23x faster than the kernels)."""
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "HAS_TRITON", True)
    assert dispatch.use_triton(_FakeCuda())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not dispatch.use_triton(_FakeCuda())
    monkeypatch.setattr(dispatch, "interpreter_enabled", lambda: True)
    assert dispatch.use_triton(_FakeCuda(), force_triton=True)


def test_layer_norm_keeps_torchs_kernel_unless_forced(monkeypatch):
    """ATen's LayerNorm beat the Triton one on an H200 at hidden <= 4096: ``enabled`` alone keeps ATen's."""
    def kernel_asked(*tensors, **options):
        raise RuntimeError("the Triton path was asked")

    monkeypatch.setattr(sys.modules["oslo_models.fused_ops.layer_norm"], "use_triton", kernel_asked)
    x, w, b = torch.randn(3, 8), torch.rand(8), torch.randn(8)
    expected = fused_ops.layer_norm_reference(x, w, b, 1e-5)
    torch.testing.assert_close(fused_ops.layer_norm(x, w, b, enabled=True), expected)
    with pytest.raises(RuntimeError, match="Triton path was asked"):
        fused_ops.layer_norm(x, w, b, force_triton=True)


def test_mixed_devices_take_the_reference():
    assert not dispatch.use_triton(_FakeCuda(), CPU)


@requires_interpreter
def test_force_triton_runs_the_kernel_on_cpu_under_the_interpreter(monkeypatch):
    rms_norm_module = importlib.import_module("oslo_models.fused_ops.rms_norm")  # the package attr is the fn

    launches = []
    launcher = rms_norm_module.rms_norm_forward
    monkeypatch.setattr(rms_norm_module, "rms_norm_forward", lambda *a: launches.append(1) or launcher(*a))
    x, w = torch.randn(3, 8), torch.ones(8)
    fused_ops.rms_norm(x, w)
    assert launches == []  # CPU without force: reference
    monkeypatch.setenv(dispatch.ENV_VAR, "0")  # force beats the debugging switch: tests rely on it
    out = fused_ops.rms_norm(x, w, force_triton=True)
    assert launches == [1]
    torch.testing.assert_close(out, fused_ops.rms_norm_reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_force_triton_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET|triton cannot be imported"):
        dispatch.use_triton(CPU, force_triton=True)


def test_public_functions_fall_back_to_reference_on_cpu():
    # Without force, CPU calls must be bit-identical to the reference (no kernel, no interpreter).
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(9, 341, generator=gen), torch.randn(341, generator=gen), torch.randn(341, generator=gen)
    assert torch.equal(fused_ops.layer_norm(x, w, b), fused_ops.layer_norm_reference(x, w, b, 1e-5))
    assert torch.equal(fused_ops.rms_norm(x, w), fused_ops.rms_norm_reference(x, w, 1e-6))
    assert torch.equal(fused_ops.bias_gelu(x, b), torch.nn.functional.gelu(x + b, approximate="tanh"))
    labels = torch.randint(0, 341, (9,), generator=gen)
    assert torch.equal(fused_ops.cross_entropy(x, labels), torch.nn.functional.cross_entropy(x, labels))


def test_import_without_triton_and_reference_path_works():
    # A fresh interpreter where `import triton` fails: the package imports and the reference path runs.
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, oslo_models.fused_ops as f\n"
        "assert not f.triton_available()\n"
        "x = torch.randn(4, 6); w = torch.ones(6)\n"
        "torch.testing.assert_close(f.rms_norm(x, w), f.rms_norm_reference(x, w, 1e-6))\n"
        "try:\n    f.rms_norm(x, w, force_triton=True)\nexcept ValueError as e:\n    print('ok', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ok force_triton=True but triton cannot be imported" in result.stdout
