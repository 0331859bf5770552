"""The fused ops wired into the models: fused on (Triton kernels under ``OSLO_FUSED_OPS=force``, the
interpreter on CPU, and the LM/MLM heads' loss-only path ``skip_logits=True``) equals fused off (plain torch,
logits materialized) in the loss and every gradient, at tp 1 and tp 2; and at tp 1 both equal ``transformers``.

Which kernels run is checked too (``OpsSeen``): bias-GELU in the GELU MLPs (GPT-2's tanh form, BERT's erf form,
T5 v1.1's gated tanh form without a bias), the chunked cross-entropy kernels in every head, and none when off.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import mlm_batch, save_tiny, save_tiny_t5, seq2seq_batch, tiny_bert_config
from tests.helpers.models import assert_grads_match, padded_batch, save_tiny_gpt2
from tests.helpers.ops import OpsSeen

pytestmark = pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()),
                                reason="needs triton with TRITON_INTERPRET=1 set before import")

GELU, CE = "oslo_models::bias_gelu", "oslo_models::cross_entropy_stats"
MOE_CONFIG = dict(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.3, pad_token_id=0, intermediate_size=24, num_hidden_layers=2,
                  num_local_experts=4)


def _causal_batch(vocab):
    ids, mask, labels = padded_batch(vocab)
    # num_items_in_batch as a gradient-accumulating trainer passes it: the loss is a sum over this count
    return dict(input_ids=ids, attention_mask=mask, num_items_in_batch=torch.tensor(11)), labels


# name -> (Auto class, transformers class, batch, kernels the fused run must show)
CASES = {
    "gpt2": ("AutoModelForCausalLM", transformers.GPT2LMHeadModel, lambda: _causal_batch(101), {GELU, CE}),
    "bert": ("AutoModelForMaskedLM", transformers.BertForMaskedLM, mlm_batch, {GELU, CE}),
    "roberta": ("AutoModelForMaskedLM", transformers.RobertaForMaskedLM, lambda: mlm_batch(pad_token_id=1),
                {GELU, CE}),
    "t5": ("AutoModelForSeq2SeqLM", transformers.T5ForConditionalGeneration, seq2seq_batch, {GELU, CE}),
    "llama": ("AutoModelForCausalLM", transformers.LlamaForCausalLM, lambda: _causal_batch(decoders.VOCAB), {CE}),
    "mixtral": ("AutoModelForCausalLM", transformers.MixtralForCausalLM, lambda: _causal_batch(61), {CE}),
}
TP2 = ("gpt2", "bert", "t5", "llama", "mixtral")  # RoBERTa's head differs from BERT's only above the decoder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_wiring")
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE_CONFIG)).save_pretrained(root / "mixtral")
    return {
        # A wide init, so the MLP inputs reach where GELU's tanh and erf forms differ (at the default 0.02 they
        # agree to 1e-7 and a swapped form would pass).
        "gpt2": save_tiny_gpt2(root / "gpt2", initializer_range=0.4),  # gelu_new
        "bert": save_tiny(root / "bert", transformers.BertForMaskedLM,
                          tiny_bert_config(initializer_range=0.4)),  # exact gelu
        "roberta": save_tiny(root / "roberta", transformers.RobertaForMaskedLM,
                             tiny_bert_config(transformers.RobertaConfig, initializer_range=0.4)),
        "t5": save_tiny_t5(root / "t5", gated=True),  # gated gelu_new, no bias, untied head
        "llama": decoders.save_tiny(root / "llama", "llama"),  # padded vocab 101 at tp 2, MLP biases, rotary
        "mixtral": str(root / "mixtral"),
    }


def run_model(path: str, name: str, *, tp: int, fused: bool):
    """One forward/backward; ``fused`` turns on the kernels (``OSLO_FUSED_OPS=force``) and ``skip_logits``."""
    auto, _, batch, kernels = CASES[name]
    os.environ["OSLO_FUSED_OPS"] = "force"  # in both runs: the config alone must keep the kernels off
    try:
        model = getattr(om, auto).from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=tp,
                                                                                    fused_ops=fused),
                                                  progress=False).train()
        inputs, labels = batch()
        with OpsSeen() as seen:
            out = model(**inputs, labels=labels, skip_logits=fused)
            out.loss.backward()
    finally:
        del os.environ["OSLO_FUSED_OPS"]
    # the experts' grouped matmul is a custom op of the same namespace but not a fused kernel: it runs either way
    ran = {op for op in seen.named("oslo_models") if not op.startswith("oslo_models::grouped_mm")}
    if fused:
        assert out.logits is None and kernels <= ran, f"{name}: fused run showed kernels {ran}, logits kept"
    else:
        assert out.logits is not None and not ran, f"{name}: unfused run ran kernels {ran}"
    return model, out.loss.detach()


def assert_on_equals_off(path: str, name: str, tp: int, truth=None):
    """Fused on equals fused off: loss, and every gradient to fp32 tolerance (atol 1e-5, rtol 1e-4).

    ``truth`` (tp=1): a function giving the float64 ``transformers`` gradients. Two fp32 paths that sum in a different
    order can differ by more than the tolerance where the sums cancel (BERT's tied word embeddings at the wide init this
    test uses: both paths are off the float64 gradient by up to 2e-5 there). So with ``truth`` an element may also pass
    by being at least as close to the float64 gradient as the unfused path is: the fused path is never less accurate
    than the unfused one."""
    off, loss_off = run_model(path, name, tp=tp, fused=False)
    on, loss_on = run_model(path, name, tp=tp, fused=True)
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} tp{tp} loss: {m}")
    grads_off = {n: p.grad for n, p in off.named_parameters()}
    for n, p in on.named_parameters():
        close = (p.grad - grads_off[n]).abs() <= 1e-5 + 1e-4 * grads_off[n].abs()
        if truth is None or bool(close.all()):
            torch.testing.assert_close(p.grad, grads_off[n], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=n: f"{name} tp{tp} {n}: {m}")
            continue
        exact = truth()[n]
        ok = close | ((p.grad.double() - exact).abs() <= (grads_off[n].double() - exact).abs())
        assert bool(ok.all()), (f"{name} tp{tp} {n}: fused differs from unfused by "
                                f"{(p.grad - grads_off[n]).abs()[~ok].max():.3g} and is further from float64")
    return on, off, loss_on


@pytest.mark.parametrize("name", list(CASES))
def test_fused_on_equals_off_and_transformers_tp1(checkpoints, name):
    _, hf_class, batch, _ = CASES[name]
    inputs, labels = batch()

    @functools.cache
    def truth() -> dict:
        exact = hf_class.from_pretrained(checkpoints[name]).double().train()
        exact(**inputs, labels=labels).loss.backward()
        return {n: p.grad for n, p in exact.named_parameters()}

    model, unfused, loss = assert_on_equals_off(checkpoints[name], name, 1, truth)
    reference = hf_class.from_pretrained(checkpoints[name]).train()
    expected = reference(**inputs, labels=labels)
    expected.loss.backward()
    torch.testing.assert_close(loss, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    # the unfused model is transformers' fp32 computation; the fused one is as accurate (above)
    assert assert_grads_match(unfused, reference) == len(list(unfused.parameters()))


def _tp2_worker(paths: dict) -> None:
    for name in TP2:
        assert_on_equals_off(paths[name], name, 2)


def test_fused_on_equals_off_tp2(checkpoints):
    run_distributed(_tp2_worker, 2, {name: checkpoints[name] for name in TP2})
