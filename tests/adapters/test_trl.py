"""TRL's fused LM head on a parallel model. TRL (>= 1.x) ``SFTTrainer`` replaces the model's forward with a head that
multiplies by the LM head's weight, which under tensor parallelism is this rank's vocabulary shard (a wrong, low
loss: 3.95 instead of 4.63 on the tiny Llama at tp 2, seen). ``ParallelTrainerMixin`` puts ``training/trl_head.py``
in its place; this checks that head against TRL's own on plain ``peft`` + ``transformers`` at tp 2 x dp 2: the
loss, every per-token field and every adapter gradient (fp32, 1e-5). TRL is in the dev extras (its requirements are
already the dev extras' own); skipped when it is not installed.

Not yet equal: a whole ``SFTTrainer`` run through the mixin (its step-1 loss matches, its gradient norm and later
steps differ by ~5e-4 even at tp 1, with the head's gradients equal: open in issue 32).
"""
from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

import oslo_models as om  # noqa: E402
from tests.adapters.test_lora import _ours, _reference, _save_case  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.zoo import tiny_config  # noqa: E402

SEQ = 8


def _head_grads(model, batch: dict, fused: bool):
    out = model(**batch, labels=batch["input_ids"], fused_lm_head=fused, use_cache=False)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _fused_worker(base: str, adapter: str, expected: dict) -> None:
    """tp 2 x dp 2: the replaced head gives TRL's fields and gradients (every rank the same batch)."""
    from trl.trainer.utils import add_fused_lm_head

    from oslo_models.training.trl_head import replace_trl_head
    from tests.adapters.test_lora import assert_adapters_match

    model = _ours("llama", base, adapter, tensor_parallel_size=2, data_parallel_size=2)
    om.distributed.mark_gradients_reduced(model, "test: the same batch on every replica, gradients compared")
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    assert replace_trl_head(model.get_base_model())
    out, _ = _head_grads(model, expected["batch"], True)
    for key in ("loss", "log_probs", "entropy", "is_top1", "label_mask"):
        torch.testing.assert_close(getattr(out, key), expected[key], atol=1e-5, rtol=1e-4, msg=key)
    reference = _reference("llama", base, adapter)  # its gradients (a pickled module would arrive without them)
    add_fused_lm_head(reference.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    _head_grads(reference, expected["batch"], True)
    assert assert_adapters_match(model, reference, grads=True) > 0


def test_fused_lm_head_contract_matches_trl_at_tp2(tmp_path):
    """TRL's fused LM head on plain peft + transformers against ours (``training/trl_head.py``) on the parallel
    model: loss, per-token log-probs, entropy, top-1 and label mask, and every adapter gradient."""
    from trl.trainer.utils import add_fused_lm_head

    base, adapter = _save_case("llama", tmp_path)
    reference = _reference("llama", base, adapter)
    add_fused_lm_head(reference.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(3, tiny_config("llama").vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(5))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    out, _ = _head_grads(reference, batch, True)
    expected = {key: getattr(out, key).detach() for key in ("loss", "log_probs", "entropy", "is_top1", "label_mask")}
    run_distributed(_fused_worker, 4, base, adapter, dict(expected, batch=batch), timeout=600)
