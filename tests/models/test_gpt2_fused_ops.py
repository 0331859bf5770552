"""GPT-2 with the fused Triton ops on equals GPT-2 with them off: loss and every gradient, under TP + SP.

On CPU the kernels run in Triton's interpreter: ``OSLO_FUSED_OPS=force`` makes every op a model calls with
fused ops enabled take the Triton path (``make test`` sets ``TRITON_INTERPRET=1``)."""
from __future__ import annotations

import os

import pytest
import torch

import oslo_models as om
from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled
from oslo_models.parallel_layers.tensor_parallel import SequenceParallelLayerNorm
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch, save_tiny_gpt2
from tests.helpers.ops import OpsSeen

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()),
                                reason="needs triton with TRITON_INTERPRET=1 set before import")


def _fused_worker(path: str) -> None:
    def run(fused: bool):
        # "force" in both runs: it must never turn on a kernel that the config (fused_ops=False) turned off.
        os.environ["OSLO_FUSED_OPS"] = "force"
        cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, fused_ops=fused)
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
        assert all(m.fused == fused for m in model.modules() if isinstance(m, SequenceParallelLayerNorm))
        ids, mask, labels = padded_batch(101)
        with OpsSeen() as seen:
            out = model(ids, attention_mask=mask, labels=labels)
            out.loss.backward()
        kernels = seen.named("oslo_models")
        assert bool(kernels) == fused, f"fused_ops={fused} under OSLO_FUSED_OPS=force ran kernels {set(kernels)}"
        return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    loss_off, grads_off = run(False)
    loss_on, grads_on = run(True)
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_gpt2_fused_ops_on_equals_off(tmp_path):
    run_distributed(_fused_worker, 2, save_tiny_gpt2(tmp_path / "src"))
