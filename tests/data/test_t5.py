"""T5SpanCorruptionCollator: inputs + targets reconstruct the original; span statistics; lengths; batches."""
from __future__ import annotations

import numpy as np
import pytest

from oslo_models.data import T5SpanCorruptionCollator, t5_lengths
from oslo_models.data.collators import random_spans_noise_mask


def reconstruct(inputs: np.ndarray, targets: np.ndarray, sentinels: set[int], eos: int) -> list[int]:
    """Put every target span back where its sentinel sits in the inputs."""
    assert inputs[-1] == eos and targets[-1] == eos
    spans, current = {}, None
    for t in targets[:-1]:
        if t in sentinels:
            current = int(t)
            spans[current] = []
        else:
            spans[current].append(int(t))
    out = []
    for t in inputs[:-1]:
        out.extend(spans.pop(int(t)) if t in sentinels else [int(t)])
    assert not spans  # every target span was used
    return out


def test_inputs_and_targets_reconstruct_the_original(t5_tokenizer):
    collate = T5SpanCorruptionCollator(t5_tokenizer, seed=0)
    sentinels = set(collate.sentinel_ids.tolist())
    rng = np.random.default_rng(0)
    for length in (2, 3, 7, 20, 100, 568):
        for _ in range(10):
            ids = rng.integers(3, 150, size=length)  # never a sentinel (150..249), pad or eos
            inputs, targets = collate.corrupt(ids)
            assert reconstruct(inputs, targets, sentinels, t5_tokenizer.eos_token_id) == ids.tolist()
            # sentinels appear in order <extra_id_0>, <extra_id_1>, ... in both
            used = [t for t in inputs if t in sentinels]
            assert used == collate.sentinel_ids[: len(used)].tolist()
            assert [t for t in targets if t in sentinels] == used


def test_noise_density_and_span_count():
    rng = np.random.default_rng(1)
    for length in (10, 100, 568):
        mask = random_spans_noise_mask(length, 0.15, 3.0, rng)
        noise = int(round(length * 0.15))
        assert mask.sum() == noise
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        assert starts.sum() == max(1, round(noise / 3.0))
        assert not mask[0] and mask[-1]  # T5 layout: starts with kept tokens, ends inside a noise span
    # the span lengths are random, with the requested mean
    lengths = []
    for _ in range(200):
        mask = random_spans_noise_mask(568, 0.15, 3.0, rng)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
        lengths += (edges[1::2] - edges[::2]).tolist()
    assert len(set(lengths)) > 3 and abs(np.mean(lengths) - 85 / 28) < 1e-9


def test_t5_lengths_match_the_paper_recipe(t5_tokenizer):
    assert t5_lengths(512) == (568, 114)  # T5's own numbers for 512-token inputs
    raw, tgt = t5_lengths(128, 0.3, 5.0)
    collate = T5SpanCorruptionCollator(t5_tokenizer, noise_density=0.3, mean_noise_span_length=5.0)
    inputs, targets = collate.corrupt(np.arange(raw) % 147 + 3)
    assert inputs.size == 128 and targets.size == tgt


def test_batch_layout_and_determinism(t5_tokenizer):
    collate = T5SpanCorruptionCollator(t5_tokenizer, seed=7)
    rng = np.random.default_rng(2)
    examples = [{"input_ids": rng.integers(3, 150, size=n)} for n in (40, 25)]
    batch = collate(examples)
    pad = t5_tokenizer.pad_token_id
    for row, ex in enumerate(examples):
        inputs, targets = collate.corrupt(ex["input_ids"])
        assert batch["input_ids"][row, : inputs.size].tolist() == inputs.tolist()
        assert (batch["input_ids"][row, inputs.size:] == pad).all()
        assert batch["attention_mask"][row].sum() == inputs.size
        assert batch["labels"][row, : targets.size].tolist() == targets.tolist()
        assert (batch["labels"][row, targets.size:] == -100).all()
        assert batch["decoder_input_ids"][row, 0] == pad
        assert batch["decoder_input_ids"][row, 1: targets.size].tolist() == targets[:-1].tolist()
    again = T5SpanCorruptionCollator(t5_tokenizer, seed=7)(examples[::-1])
    n0 = int((batch["labels"][0] != -100).sum())
    assert again["labels"][1, :n0].tolist() == batch["labels"][0, :n0].tolist()  # batch order does not matter
    other = T5SpanCorruptionCollator(t5_tokenizer, seed=8)(examples)
    assert other["labels"].tolist() != batch["labels"].tolist()


def test_errors(bpe_tokenizer, t5_tokenizer):
    with pytest.raises(ValueError, match="sentinel"):
        T5SpanCorruptionCollator(bpe_tokenizer)
    with pytest.raises(ValueError, match="noise_density"):
        T5SpanCorruptionCollator(t5_tokenizer, noise_density=1.0)
    with pytest.raises(ValueError, match="sentinel ids"):
        T5SpanCorruptionCollator(t5_tokenizer, sentinel_ids=[5]).corrupt(np.arange(3, 200))
    with pytest.raises(ValueError, match="at least 2"):
        T5SpanCorruptionCollator(t5_tokenizer).corrupt(np.array([5]))
