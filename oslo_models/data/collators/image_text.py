"""Image-text batches: the model's processor run on ``(image, prompt, text)`` samples, prompt and image tokens masked
from the loss, one sample per row or several packed per row.

    collator = om.data.ImageTextCollator(processor)                # one sample per row, right padding
    collator = om.data.ImageTextCollator(processor, pack_to=256)   # samples packed first-fit into rows of 256

A sample is a dict ``{"image": PIL image / array, "prompt": str, "text": str}`` (keys configurable). The prompt holds
the processor's image placeholder (e.g. ``"<image>"``; prepended when missing). Each sample is encoded as
``processor(images=[image], text=[prompt])`` (the processor expands the placeholder into the model's image tokens and
computes the image tensors) followed by ``tokenizer(text)`` without special tokens and the eos token; ``labels`` are
``-100`` on the prompt (its image tokens included) and the padding, the text's ids and eos elsewhere. So the loss is
the caption's, and rows carry different numbers of label tokens.

Output: ``input_ids`` / ``attention_mask`` / ``labels`` ``[rows, length]`` (int64), per-token keys of the processor
(``token_type_ids``, ``mm_token_type_ids``) padded with 0, and the image tensors (``pixel_values``, ``image_sizes``,
``image_grid_thw``, ...) concatenated along their first (image) dimension in the order their image tokens appear,
which is the order ``transformers`` merges the features in.

Packing (``pack_to``): samples first-fit into rows of ``pack_to`` tokens (``packing.first_fit``, order kept within a
row), with ``position_ids`` restarting at 0 for every sample and ``cu_seqlens`` (int32 offsets over the flattened
rows, each row's trailing padding a segment of its own): the models attend per sample (``utils/documents.py``; the
generic path's ``packed_attention`` pre-hook), so loss and gradients equal one sample per row. Refused (with the
reason) for processors whose outputs the per-document masks cannot honour yet: Qwen-VL's M-RoPE
(``image_grid_thw`` / ``mm_token_type_ids``: positions computed over the whole row), Gemma 3's bidirectional image
attention (``token_type_ids``) and Idefics3 / SmolVLM's per-row image stacks (``pixel_attention_mask``).

No collective; everything runs on the host.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .packing import first_fit

_TEXT_KEYS = ("input_ids", "attention_mask")
_PER_TOKEN = ("token_type_ids", "mm_token_type_ids")
_NOT_PACKABLE = {
    "image_grid_thw": "Qwen-VL's M-RoPE positions are computed over the whole row from image_grid_thw, so they "
                      "would not restart per sample",
    "mm_token_type_ids": "Qwen-VL's M-RoPE positions are computed over the whole row, so they would not restart "
                         "per sample",
    "token_type_ids": "Gemma 3's bidirectional attention inside an image (token_type_ids) is not combined with the "
                      "per-sample masks",
    "pixel_attention_mask": "Idefics3 / SmolVLM stack each row's images in one [rows, images, ...] tensor",
}


class ImageTextCollator:
    """See the module docstring. ``processor``: the model's ``transformers`` processor (a ``tokenizer`` attribute
    with a pad and an eos token); ``pack_to``: the row budget in tokens (``None``: one sample per row);
    ``max_length``: samples longer than this are refused (a cut image would not match its features)."""

    def __init__(self, processor, *, pack_to: int | None = None, max_length: int | None = None,
                 image_key: str = "image", prompt_key: str = "prompt", text_key: str = "text",
                 add_eos: bool = True):
        tokenizer = getattr(processor, "tokenizer", None)
        if tokenizer is None or tokenizer.pad_token_id is None:
            raise ValueError("ImageTextCollator needs a processor whose tokenizer has a pad token")
        if pack_to is not None and pack_to <= 0:
            raise ValueError(f"pack_to must be a positive number of tokens, got {pack_to}")
        self.processor, self.tokenizer = processor, tokenizer
        self.pack_to, self.max_length, self.add_eos = pack_to, max_length, add_eos
        self.keys = (image_key, prompt_key, text_key)
        self.placeholder = getattr(processor, "image_token", None) or "<image>"

    def encode(self, sample: dict) -> dict:
        """One sample: ``{input_ids, labels, per-token keys: [length]; image tensors: [images, ...]}``."""
        image_key, prompt_key, text_key = self.keys
        prompt = sample.get(prompt_key) or ""
        if self.placeholder not in prompt:
            prompt = f"{self.placeholder} {prompt}".strip()
        encoded = self.processor(images=[sample[image_key]], text=[prompt], return_tensors="pt")
        text = self.tokenizer(sample[text_key], add_special_tokens=False)["input_ids"]
        if self.add_eos:
            text = [*text, self.tokenizer.eos_token_id]
        prompt_ids = encoded["input_ids"][0]
        out = {"input_ids": torch.cat([prompt_ids, torch.tensor(text, dtype=torch.long)]),
               "labels": torch.cat([torch.full_like(prompt_ids, -100), torch.tensor(text, dtype=torch.long)])}
        for key in _PER_TOKEN:
            if key in encoded:
                out[key] = torch.cat([encoded[key][0], torch.zeros(len(text), dtype=encoded[key].dtype)])
        for key, value in encoded.items():
            if key not in _TEXT_KEYS and key not in _PER_TOKEN:
                out[key] = value
        if self.max_length is not None and out["input_ids"].numel() > self.max_length:
            raise ValueError(f"a sample of {out['input_ids'].numel()} tokens is longer than max_length="
                             f"{self.max_length}; image tokens cannot be cut")
        return out

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(sample) for sample in samples]
        if self.pack_to is None:
            rows = [[index] for index in range(len(encoded))]
            length = max(e["input_ids"].numel() for e in encoded)
        else:
            refused = sorted(key for key in _NOT_PACKABLE if key in encoded[0])
            if refused:
                raise NotImplementedError("ImageTextCollator(pack_to=...) for this processor: "
                                          + "; ".join(_NOT_PACKABLE[key] for key in refused)
                                          + ". Use one sample per row (pack_to=None)")
            rows = first_fit([e["input_ids"].numel() for e in encoded], self.pack_to)
            length = self.pack_to
        return self._rows(encoded, rows, length)

    def _rows(self, encoded: list[dict], rows: list[list[int]], length: int) -> dict[str, torch.Tensor]:
        shape = (len(rows), length)
        batch = {"input_ids": torch.full(shape, self.tokenizer.pad_token_id, dtype=torch.long),
                 "attention_mask": torch.zeros(shape, dtype=torch.long),
                 "labels": torch.full(shape, -100, dtype=torch.long)}
        for key in _PER_TOKEN:
            if key in encoded[0]:
                batch[key] = torch.zeros(shape, dtype=encoded[0][key].dtype)
        packed = self.pack_to is not None
        if packed:
            batch["position_ids"] = torch.zeros(shape, dtype=torch.long)
            offsets = [0]
        images: dict[str, list[torch.Tensor]] = {}
        for r, members in enumerate(rows):
            start = 0
            for index in members:
                sample = encoded[index]
                end = start + sample["input_ids"].numel()
                for key in ("input_ids", "labels", *(k for k in _PER_TOKEN if k in sample)):
                    batch[key][r, start:end] = sample[key]
                batch["attention_mask"][r, start:end] = 1
                if packed:
                    batch["position_ids"][r, start:end] = torch.arange(end - start)
                    offsets.append(r * length + end)
                for key, value in sample.items():
                    if key not in batch:
                        images.setdefault(key, []).append(value)
                start = end
            if packed and start < length:
                offsets.append((r + 1) * length)  # the row's padding: a segment of its own
        for key, values in images.items():
            batch[key] = torch.cat(values)
        if packed:
            batch["cu_seqlens"] = torch.tensor(offsets, dtype=torch.int32)
        return batch
