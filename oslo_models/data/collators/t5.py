"""T5 span corruption (Raffel et al. 2020, section 3.1.4): noise spans replaced by sentinels."""
from __future__ import annotations

import numpy as np
import torch

from ._utils import as_tokens, example_rng, field
from .causal import collate_seq2seq


def t5_lengths(inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0):
    """``(raw_length, targets_length)``: how many raw tokens to corrupt so the inputs are ``inputs_length`` long.

    The T5 recipe packs ``raw_length`` tokens per sample (568 for 512-token inputs at the defaults) so that, after
    spans collapse into sentinels and EOS is appended, the encoder sees exactly ``inputs_length`` tokens.
    """
    def lengths(raw):
        noise = int(round(raw * noise_density))
        spans = max(1, int(round(noise / mean_noise_span_length)))
        return raw - noise + spans + 1, noise + spans + 1

    raw = inputs_length
    while lengths(raw + 1)[0] <= inputs_length:
        raw += 1
    return raw, lengths(raw)[1]


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """bool ``[length]``: ``round(length * noise_density)`` noise tokens in ``round(noise / mean)`` spans.

    As in T5: the noise and non-noise token counts are each split into that many non-empty segments at random, and
    the segments alternate, starting with non-noise, so the sequence ends inside a noise span.
    """
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(min(int(round(num_noise / mean_noise_span_length)), num_noise, length - num_noise), 1)

    def segment(total: int) -> np.ndarray:
        # choose num_spans-1 distinct cut points in 1..total-1: num_spans non-empty segments
        cuts = np.sort(rng.choice(np.arange(1, total), size=num_spans - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [total]]))

    noise_lengths, keep_lengths = segment(num_noise), segment(length - num_noise)
    span_lengths = np.stack([keep_lengths, noise_lengths], axis=1).reshape(-1)
    is_noise = np.tile([False, True], num_spans)
    return np.repeat(is_noise, span_lengths)


class T5SpanCorruptionCollator:
    """Span-corruption batches for T5-style encoder-decoder pretraining.

    For every example (ids from ``input_ids``; e.g. samples of ``PackedCausalLMDataset`` of ``t5_lengths(...)[0]``
    tokens), a noise mask (density ``noise_density``, spans of mean length ``mean_noise_span_length``) is drawn.
    Inputs keep the non-noise tokens and replace noise span ``k`` by sentinel ``k``; targets are sentinel ``k``
    followed by span ``k``, for every span; both end with EOS. Output (``int64``): ``input_ids``/``attention_mask``
    ``[batch, src]``, ``labels`` ``[batch, tgt]`` (-100 padding) and ``decoder_input_ids`` (labels shifted right,
    starting with ``decoder_start_token_id`` = the pad id, as T5 does).

    Sentinels default to the tokenizer's ``<extra_id_0>``, ``<extra_id_1>``, ...; pass ``sentinel_ids`` to use
    others. The noise is keyed on ``(seed, example tokens)`` (see :class:`MLMCollator`).
    """

    def __init__(self, tokenizer=None, *, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                 sentinel_ids=None, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 decoder_start_token_id: int | None = None, append_eos: bool = True, seed: int = 0,
                 pad_to_multiple_of: int | None = None):
        if not 0.0 < noise_density < 1.0:
            raise ValueError(f"noise_density must be in (0, 1), got {noise_density}")
        if mean_noise_span_length < 1:
            raise ValueError(f"mean_noise_span_length must be >= 1, got {mean_noise_span_length}")
        if sentinel_ids is None:
            if tokenizer is None:
                raise ValueError("pass a tokenizer with <extra_id_N> tokens, or sentinel_ids=")
            vocab = tokenizer.get_vocab()
            sentinel_ids, k = [], 0
            while f"<extra_id_{k}>" in vocab:
                sentinel_ids.append(vocab[f"<extra_id_{k}>"])
                k += 1
            if not sentinel_ids:
                raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no <extra_id_N> sentinel tokens")
        self.sentinel_ids = np.asarray(sentinel_ids, dtype=np.int64)
        self.eos_id = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        if append_eos and self.eos_id is None:
            raise ValueError("append_eos needs an eos_token_id (the tokenizer has none)")
        self.pad_id = pad_token_id if pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
        if self.pad_id is None:
            raise ValueError("T5SpanCorruptionCollator needs a pad_token_id")
        self.decoder_start_id = self.pad_id if decoder_start_token_id is None else int(decoder_start_token_id)
        self.noise_density, self.mean_noise_span_length = float(noise_density), float(mean_noise_span_length)
        self.append_eos, self.seed, self.pad_to_multiple_of = append_eos, int(seed), pad_to_multiple_of

    def corrupt(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, targets)`` for one 1-D int64 sequence of at least 2 tokens."""
        if ids.size < 2:
            raise ValueError(f"span corruption needs at least 2 tokens, got {ids.size}")
        rng = example_rng(self.seed, ids, salt=5)
        noise = random_spans_noise_mask(ids.size, self.noise_density, self.mean_noise_span_length, rng)
        span_start = noise & ~np.concatenate([[False], noise[:-1]])
        span_id = np.cumsum(span_start) - 1  # index of the noise span each token is in (valid where noise)
        num_spans = int(span_start.sum())
        if num_spans > self.sentinel_ids.size:
            raise ValueError(f"{num_spans} noise spans but only {self.sentinel_ids.size} sentinel ids")
        # inputs: non-noise tokens, and the sentinel in place of the first token of each span
        inputs = np.where(span_start, self.sentinel_ids[np.maximum(span_id, 0)], ids)[~noise | span_start]
        # targets: the noise tokens in order, with one slot before each span for its sentinel
        order = np.flatnonzero(noise)
        targets = np.empty(order.size + num_spans, dtype=np.int64)
        positions = np.arange(order.size) + span_id[order] + 1
        targets[positions] = ids[order]
        targets[positions[span_start[order]] - 1] = self.sentinel_ids[:num_spans]
        if self.append_eos:
            inputs = np.append(inputs, self.eos_id)
            targets = np.append(targets, self.eos_id)
        return inputs, targets

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        pairs = [self.corrupt(as_tokens(field(e))) for e in examples]
        return collate_seq2seq([p[0] for p in pairs], [p[1] for p in pairs], pad_id=self.pad_id,
                               decoder_start_id=self.decoder_start_id, pad_to_multiple_of=self.pad_to_multiple_of)
