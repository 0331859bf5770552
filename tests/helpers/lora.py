"""Comparing a parallel model's LoRA adapters with a single-process ``peft`` reference's."""
from __future__ import annotations

import torch


def _full(tensor):
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def lora_adapters(model) -> dict:
    """``{name: full tensor}`` of every LoRA parameter this rank holds (DTensors gathered to full)."""
    return {name: _full(param).clone() for name, param in model.named_parameters() if "lora_" in name}


def assert_adapters(local: dict, reference, atol: float = 1e-5, *, count: int | None = None) -> None:
    """Each adapter in ``local`` equals the reference's of the same name; ``count``: how many there must be (else at
    least one)."""
    full = dict(reference.named_parameters())
    if count is None:
        assert local
    else:
        assert len(local) == len([n for n in full if "lora_" in n]) == count
    for name, value in local.items():
        torch.testing.assert_close(value, full[name].detach(), atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
