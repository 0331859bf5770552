"""Tiny BERT / RoBERTa / T5 checkpoints and the shared "3 AdamW steps equal transformers" check."""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.helpers import zoo
from tests.helpers.models import assert_grads_match, assert_params_match, padded_batch

VOCAB = zoo.tiny_kwargs("bert")["vocab_size"]  # 101, not divisible by 2 or 4: the vocab-parallel layers pad it
assert {zoo.tiny_kwargs(t)["vocab_size"] for t in ("bert", "roberta", "t5")} == {VOCAB} and VOCAB % 2 == 1


def tiny_bert_config(cls=transformers.BertConfig, **overrides):
    """The zoo's tiny model of ``cls``' model type (``BertConfig``, ``RobertaConfig``, ``XLMRobertaConfig``, ...:
    the BERT sizes, with RoBERTa's special tokens for the RoBERTa types), with ``overrides``."""
    return zoo.tiny_config(cls.model_type, **overrides)


def tiny_t5_config(feed_forward_proj: str = "relu", **overrides) -> transformers.T5Config:
    """The zoo's tiny T5 with ``feed_forward_proj`` and ``overrides``."""
    return zoo.tiny_config("t5", feed_forward_proj=feed_forward_proj, **overrides)


def save_tiny(path, model_cls, config, *, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(path)
    return str(path)


def save_tiny_t5(path, *, gated: bool, seed: int = 0) -> str:
    """T5 with ReLU FF and a tied, rescaled head; or T5 v1.1 / Flan-T5 style: gated-GELU FF, no rescale and an
    untied ``lm_head.weight`` stored next to ``shared.weight`` (transformers unties such a checkpoint)."""
    config = tiny_t5_config("gated-gelu" if gated else "relu", tie_word_embeddings=not gated)
    save_tiny(path, transformers.T5ForConditionalGeneration, config, seed=seed)
    if gated:
        file = os.path.join(path, "model.safetensors")
        state = load_file(file)
        state["lm_head.weight"] = torch.randn(VOCAB, 32, generator=torch.Generator().manual_seed(seed + 1))
        save_file(state, file, metadata={"format": "pt"})
    return str(path)


def mlm_batch(pad_token_id: int = 0):
    """Right-padded batch of unequal lengths with token types; labels -100 on padding and on half the tokens."""
    ids, mask, labels = padded_batch(VOCAB, batch=3, seq=8)
    ids = ids.masked_fill(ids == pad_token_id, 5).masked_fill(mask == 0, pad_token_id)  # pad only on padding
    labels = labels.masked_fill(torch.arange(8) % 2 == 1, -100)
    token_type_ids = (torch.arange(8) >= 4).long().expand(3, 8).contiguous() * mask
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids), labels


def seq2seq_batch():
    """Padded encoder inputs (length 8) and padded decoder labels (length 4, so SP splits both at tp 2 and 4)."""
    ids, mask, _ = padded_batch(VOCAB, batch=3, seq=8)
    dec_ids, dec_mask, labels = padded_batch(VOCAB, batch=3, seq=4, seed=2)
    dec_mask[2] = torch.tensor([1, 1, 0, 0])
    labels = dec_ids.masked_fill(dec_mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, decoder_attention_mask=dec_mask), labels


def assert_steps_match(model, reference, inputs: dict, labels, *, steps: int = 3, logits_key: str = "logits",
                       eps: float = 1e-6, **label_kwargs) -> None:
    """Logits, loss, every gradient and the parameters after each of ``steps`` AdamW steps equal the reference.

    eps=1e-6 (as the GPT-2 parity test): Adam turns float-noise gradients into full-size steps of random sign;
    a larger eps keeps the comparison about the parallel math, identically on both sides. A layout that reorders
    more sums (the 2.5D/3D grids) passes a larger ``eps`` for the same reason.
    """
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1, eps=eps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=eps)
    kwargs = dict(inputs, **label_kwargs) if labels is None else dict(inputs, labels=labels, **label_kwargs)
    for _ in range(steps):
        expected, got = reference(**kwargs), model(**kwargs)
        # atol 2e-5: on an AVX-512 CPU (the vector width sets the order of fp32 sums) 1-3 of the 1212 logits of the
        # tp=2/4 T5 came out 1.13e-5 and 1.23e-5 off, the rest within 1e-6; the loss, every gradient and every
        # parameter after each AdamW step keep their tolerances
        torch.testing.assert_close(got[logits_key], expected[logits_key], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
        expected.loss.backward()
        got.loss.backward()
        assert assert_grads_match(model, reference) == len(list(model.parameters()))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, reference)


@pytest.fixture
def single_thread():
    """In-process (tp=1) runs use one intra-op thread, as the spawned ranks do: on the shared 2-core CI box,
    torch's default thread pool makes these tiny matmuls many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
