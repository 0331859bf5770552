"""BERT-style masked-LM collator (80/10/10), with optional whole-word masking."""
from __future__ import annotations

import numpy as np
import torch

from ._utils import as_tokens, example_rng, field, pad, padded_length

# How tokenizers mark word pieces: WordPiece prefixes continuations ("##"); byte-level BPE (GPT-2, RoBERTa) and
# SentencePiece mark the start of a word instead ("Ġ", "▁").
_CONTINUATION_PREFIX = "##"
_WORD_START_MARKERS = ("Ġ", "▁")


def word_start_table(tokenizer) -> np.ndarray:
    """bool ``[len(tokenizer)]``: True where a token begins a new word (special tokens always do).

    Detects the convention from the vocabulary: WordPiece (``##`` continuations), else byte-level BPE / SentencePiece
    (``Ġ`` / ``▁`` word starts). Raises ``ValueError`` for a vocabulary with neither.
    """
    vocab = tokenizer.get_vocab()
    table = np.zeros(len(tokenizer), dtype=bool)
    tokens = list(vocab.items())
    if any(t.startswith(_CONTINUATION_PREFIX) and len(t) > 2 for t, _ in tokens):
        for t, i in tokens:
            table[i] = not t.startswith(_CONTINUATION_PREFIX)
    else:
        marker = next((m for m in _WORD_START_MARKERS if any(t.startswith(m) for t, _ in tokens)), None)
        if marker is None:
            raise ValueError("cannot tell word boundaries from this vocabulary (no '##', 'Ġ' or '▁' tokens); "
                             "use whole_word_mask=False")
        for t, i in tokens:
            table[i] = t.startswith(marker)
    table[list(tokenizer.all_special_ids)] = True
    return table


class MLMCollator:
    """Masked-LM batches like ``transformers.DataCollatorForLanguageModeling(mlm=True)``, deterministic by seed.

    Each non-special, non-padding token is selected with probability ``mlm_probability`` (with
    ``whole_word_mask``, each *word* is, and all its pieces go together). A selected token becomes ``[MASK]`` with
    probability ``mask_replace_prob`` (0.8), a uniformly random id in ``[0, len(tokenizer))`` with
    ``random_replace_prob`` (0.1), and stays as is otherwise (0.1).

    Output, ``int64`` ``[batch, seq]``: ``input_ids`` (corrupted, right-padded), ``attention_mask``, ``labels``
    (the original id where selected, -100 elsewhere), plus ``token_type_ids`` when examples carry them.

    The noise of each example is drawn from a Generator keyed on ``(seed, example tokens)``, so a sample is masked
    the same way whatever batch, worker, rank or restart it lands in; identical samples get identical masks.
    """

    def __init__(self, tokenizer, *, mlm_probability: float = 0.15, mask_replace_prob: float = 0.8,
                 random_replace_prob: float = 0.1, whole_word_mask: bool = False, seed: int = 0,
                 pad_to_multiple_of: int | None = None):
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if mask_replace_prob < 0 or random_replace_prob < 0 or mask_replace_prob + random_replace_prob > 1:
            raise ValueError("need mask_replace_prob, random_replace_prob >= 0 with a sum <= 1")
        if tokenizer.mask_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no mask token; MLM needs one")
        if tokenizer.pad_token_id is None:
            raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no pad token")
        self.mask_id, self.pad_id = int(tokenizer.mask_token_id), int(tokenizer.pad_token_id)
        self.vocab_size = len(tokenizer)
        self.special = np.zeros(self.vocab_size, dtype=bool)
        self.special[list(tokenizer.all_special_ids)] = True
        self.word_start = word_start_table(tokenizer) if whole_word_mask else None
        self.mlm_probability = float(mlm_probability)
        self.mask_replace_prob, self.random_replace_prob = float(mask_replace_prob), float(random_replace_prob)
        self.seed = int(seed)
        self.pad_to_multiple_of = pad_to_multiple_of

    def mask_tokens(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(corrupted ids, labels)`` for one 1-D int64 sequence."""
        rng = example_rng(self.seed, ids)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token id outside [0, {self.vocab_size}) for this tokenizer")
        maskable = ~self.special[ids]
        if self.word_start is None:
            selected = maskable & (rng.random(ids.size) < self.mlm_probability)
        else:
            # word number of every token: a new word starts at a word-start token or after a special token
            starts = self.word_start[ids] | np.concatenate([[True], ~maskable[:-1]])
            word = np.cumsum(starts) - 1
            chosen = rng.random(int(word[-1]) + 1 if ids.size else 0) < self.mlm_probability
            selected = maskable & chosen[word] if ids.size else maskable
        u = rng.random(ids.size)
        random_ids = rng.integers(0, self.vocab_size, size=ids.size)
        out = ids.copy()
        to_mask = selected & (u < self.mask_replace_prob)
        to_random = selected & (u >= self.mask_replace_prob) & (u < self.mask_replace_prob + self.random_replace_prob)
        out[to_mask] = self.mask_id
        out[to_random] = random_ids[to_random]
        labels = np.where(selected, ids, -100)
        return out, labels

    def __call__(self, examples) -> dict[str, torch.Tensor]:
        if len(examples) == 0:
            raise ValueError("cannot collate an empty list of examples")
        ids = [as_tokens(field(e)) for e in examples]
        corrupted, labels = zip(*(self.mask_tokens(s) for s in ids))
        lengths = [s.size for s in ids]
        length = padded_length(lengths, self.pad_to_multiple_of)
        batch = {
            "input_ids": pad(corrupted, self.pad_id, length),
            "attention_mask": torch.from_numpy(np.arange(length)[None, :] < np.asarray(lengths)[:, None]).long(),
            "labels": pad(labels, -100, length),
        }
        if all(isinstance(e, dict) and "token_type_ids" in e for e in examples):
            batch["token_type_ids"] = pad([as_tokens(e["token_type_ids"]) for e in examples], 0, length)
        return batch
