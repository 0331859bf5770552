"""``transformers``' activation checkpointing switch by the name the installed release has."""
from __future__ import annotations


def enable_checkpointing(model, kwargs: dict | None = None) -> None:
    """``activation_checkpointing_enable`` (``transformers`` >= 5.23; ``gradient_checkpointing_enable`` is its
    deprecated alias there, a ``FutureWarning``), else ``gradient_checkpointing_enable`` (older releases). ``kwargs``:
    the checkpointing kwargs (``{"mode": ...}`` and ``torch.utils.checkpoint``'s)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def disable_checkpointing(model) -> None:
    """``activation_checkpointing_disable``, else (older ``transformers``) ``gradient_checkpointing_disable``."""
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or model.gradient_checkpointing_disable)()
