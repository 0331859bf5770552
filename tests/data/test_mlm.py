"""MLMCollator: masking rate and 80/10/10 within statistical bounds, whole-word masking, determinism."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oslo_models.data import MLMCollator
from oslo_models.data.collators import word_start_table

from .conftest import sentences


def _within(observed: float, expected: float, n: int, sigmas: float = 4.0) -> bool:
    return abs(observed - expected) <= sigmas * np.sqrt(expected * (1 - expected) / n)


def test_masking_rate_and_80_10_10(wordpiece_tokenizer):
    tok = wordpiece_tokenizer
    vocab = len(tok)
    rng = np.random.default_rng(0)
    cls, sep = tok.cls_token_id, tok.sep_token_id
    examples = [{"input_ids": [cls, *rng.integers(5, vocab, size=int(rng.integers(100, 300))), sep]}
                for _ in range(200)]
    batch = MLMCollator(tok, seed=1)(examples)
    ids, labels, attn = batch["input_ids"].numpy(), batch["labels"].numpy(), batch["attention_mask"].numpy()
    orig = np.full_like(ids, tok.pad_token_id)
    for i, e in enumerate(examples):
        orig[i, : len(e["input_ids"])] = e["input_ids"]
    eligible = (attn == 1) & (orig != cls) & (orig != sep)
    selected = labels != -100
    assert not (selected & ~eligible).any()  # specials and padding are never selected
    assert (labels[selected] == orig[selected]).all()
    assert (ids[~selected] == orig[~selected]).all()  # nothing else changes
    n, m = int(eligible.sum()), int(selected.sum())
    assert n > 35_000
    assert _within(m / n, 0.15, n)
    masked = ids[selected] == tok.mask_token_id
    kept = ids[selected] == orig[selected]
    rand = ~masked & ~kept
    # a random replacement draws the original id with probability 1/vocab, and [MASK] with 1/vocab
    assert _within(masked.mean(), 0.8 + 0.1 / vocab, m)
    assert _within(kept.mean(), 0.1 + 0.1 / vocab, m)
    assert _within(rand.mean(), 0.1 * (1 - 2 / vocab), m)


def test_custom_probabilities(wordpiece_tokenizer):
    rng = np.random.default_rng(1)
    examples = [rng.integers(5, len(wordpiece_tokenizer), size=200) for _ in range(100)]
    batch = MLMCollator(wordpiece_tokenizer, mlm_probability=0.4, mask_replace_prob=1.0, random_replace_prob=0.0,
                        seed=0)(examples)
    selected = batch["labels"] != -100
    assert _within(selected.float().mean().item(), 0.4, 20_000)
    assert (batch["input_ids"][selected] == wordpiece_tokenizer.mask_token_id).all()


def test_mask_depends_only_on_seed_and_example(wordpiece_tokenizer):
    rng = np.random.default_rng(2)
    a, b, c = (list(rng.integers(5, 100, size=n)) for n in (50, 70, 30))
    collate = MLMCollator(wordpiece_tokenizer, seed=3)
    alone = collate([a])
    mixed = collate([c, a, b])
    assert torch.equal(mixed["input_ids"][1, :50], alone["input_ids"][0])
    assert torch.equal(mixed["labels"][1, :50], alone["labels"][0])
    other = MLMCollator(wordpiece_tokenizer, seed=4)([a])
    assert not torch.equal(other["labels"], alone["labels"])


def test_whole_word_masking(wordpiece_tokenizer):
    tok = wordpiece_tokenizer
    table = word_start_table(tok)
    texts = sentences(400, seed=5)
    examples = [tok(t)["input_ids"] for t in texts]  # [CLS] ... [SEP]
    batch = MLMCollator(tok, whole_word_mask=True, seed=0)(examples)
    words_total = words_selected = 0
    multi_piece = 0
    for row, ex in enumerate(examples):
        sel = (batch["labels"][row, : len(ex)] != -100).numpy()
        ex = np.asarray(ex)
        starts = np.flatnonzero(table[ex])
        bounds = list(starts) + [len(ex)]
        for s, e in zip(bounds[:-1], bounds[1:]):
            if ex[s] in tok.all_special_ids:
                assert not sel[s:e].any()
                continue
            words_total += 1
            multi_piece += e - s > 1
            assert sel[s:e].all() or not sel[s:e].any(), "a word was partly masked"
            words_selected += bool(sel[s])
    assert multi_piece > 1000  # the test actually has words of several pieces
    assert _within(words_selected / words_total, 0.15, words_total)


def test_word_start_conventions(bpe_tokenizer, t5_tokenizer):
    vocab = bpe_tokenizer.get_vocab()
    table = word_start_table(bpe_tokenizer)
    assert table[vocab["Ġtoken"]] and not table[vocab["b"]]
    sp = word_start_table(t5_tokenizer)
    assert sp[t5_tokenizer.get_vocab()["▁blend"]]


def test_errors(bpe_tokenizer, wordpiece_tokenizer):
    with pytest.raises(ValueError, match="mask token"):
        MLMCollator(bpe_tokenizer)
    with pytest.raises(ValueError, match="mlm_probability"):
        MLMCollator(wordpiece_tokenizer, mlm_probability=0.0)
    with pytest.raises(ValueError, match="sum"):
        MLMCollator(wordpiece_tokenizer, mask_replace_prob=0.8, random_replace_prob=0.3)
    with pytest.raises(ValueError, match="outside"):
        MLMCollator(wordpiece_tokenizer)([[5, 6, 10_000]])
