"""Image-text batches for the tiny models of ``models.py``: one image per row, built token by token (no processor).

A row is ``[bos, prompt..., <image tokens>, caption..., eos, pad...]``: the prompt and the image tokens are masked from
the loss (``-100``), only the caption and eos carry labels, and rows have different prompt / caption lengths (so
different label counts) and right padding. Qwen rows wrap the image in ``<|vision_start|> ... <|vision_end|>`` (its
M-RoPE positions are computed from them). ``rows(batch, index)`` takes rows out of a batch, following each type's
image tensors (Qwen's flattened patches, ``image_grid_thw``, ``image_sizes``, ``pixel_attention_mask``).
"""
from __future__ import annotations

import torch

from tests.image_text.models import IMAGE_TOKEN, VISION_END, VISION_START

QWEN = ("qwen2_5_vl", "qwen3_vl")
_SIDE = {"qwen2_5_vl": 8, "qwen3_vl": 8}  # image side in pixels (others: 28)


def image_tokens(name: str, model) -> int:
    """How many image tokens one image of this module's size becomes (the count the processor would expand to)."""
    if name in QWEN:
        return (_SIDE[name] // 2) ** 2 // 4  # patch 2, merged 2x2
    if name == "llava_next":
        inputs = _pixels(name, 1, torch.Generator().manual_seed(0))
        features = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  image_sizes=inputs["image_sizes"])
        features = getattr(features, "pooler_output", features)
        return int(torch.cat(list(features)).shape[0])
    return {"llava": 16, "gemma3": 4, "mistral3": 4, "idefics3": 4, "smolvlm": 4}[name]


def _pixels(name: str, n: int, gen) -> dict:
    if name in QWEN:
        side = _SIDE[name]
        patches = (side // 2) ** 2
        return {"pixel_values": torch.randn(n * patches, 3 * 2 * 2 * 2, generator=gen),
                "image_grid_thw": torch.tensor([[1, side // 2, side // 2]] * n)}
    if name == "llava_next":
        return {"pixel_values": torch.randn(n, 3, 3, 28, 28, generator=gen),
                "image_sizes": torch.tensor([[28, 56]] * n)}
    pixels = torch.randn(n, 3, 28, 28, generator=gen)
    if name == "mistral3":
        return {"pixel_values": pixels, "image_sizes": torch.tensor([[28, 28]] * n)}
    if name in ("idefics3", "smolvlm"):
        return {"pixel_values": pixels[:, None], "pixel_attention_mask": torch.ones(n, 1, 28, 28, dtype=torch.bool)}
    return {"pixel_values": pixels}


def make_batch(name: str, model, rows: int = 4, seed: int = 0, shift_image: int = 0) -> dict:
    """``rows`` image-text rows for type ``name`` (see the module docstring). ``shift_image`` moves every row's
    image tokens right by that many positions (a negative control: image features merged one token off)."""
    gen = torch.Generator().manual_seed(seed)
    count = image_tokens(name, model)
    ids, labels = [], []
    for row in range(rows):
        prompt = torch.randint(3, 90, (1 + row % 3,), generator=gen).tolist()
        caption = torch.randint(3, 90, (2 + (row * 2) % 5,), generator=gen).tolist()
        image = [IMAGE_TOKEN] * count
        if name in QWEN:
            image = [VISION_START, *image, VISION_END]
        seq = [1, *prompt, *image, *caption, 2]
        masked = 1 + len(prompt) + len(image)
        lab = [-100] * masked + caption + [2]
        if shift_image:
            start = 1 + len(prompt)
            seq[start:start + len(image) + shift_image] = seq[start + len(image):start + len(image) + shift_image] \
                + image
        ids.append(seq)
        labels.append(lab)
    length = max(map(len, ids))
    batch = {
        "input_ids": torch.tensor([s + [0] * (length - len(s)) for s in ids]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in ids]),
        "labels": torch.tensor([s + [-100] * (length - len(s)) for s in labels]),
        **_pixels(name, rows, gen),
    }
    if name == "gemma3":
        batch["token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).long()
    if name in QWEN:  # what Qwen's processor returns next to input_ids: M-RoPE reads the image tokens' places from it
        batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).int()
    return batch


def rows(batch: dict, index) -> dict:
    """The rows ``index`` (a slice or a list) of ``batch``, each image tensor following its rows."""
    n = batch["input_ids"].shape[0]
    picked = list(range(n))[index] if isinstance(index, slice) else list(index)
    out = {}
    for key, value in batch.items():
        if key == "pixel_values" and "image_grid_thw" in batch:  # flattened patches, each image's in turn
            sizes = batch["image_grid_thw"].prod(-1).tolist()
            parts = torch.split(value, sizes)
            out[key] = torch.cat([parts[i] for i in picked])
        else:
            out[key] = value[picked]
    return out
