"""Parameter-efficient fine-tuning of parallel models with ``peft`` (LoRA at any tensor/sequence/pipeline/ZeRO layout).

``peft`` is optional: nothing here imports it until a name below is used (``oslo_models.adapters.lora`` needs it).

    from oslo_models import adapters
    model = peft.get_peft_model(model, adapters.lora_config(r=16, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained("adapter/", is_main_process=rank == 0)   # every rank (tp, ZeRO): a plain peft folder
    adapters.save_adapter(model, "adapter/")   # every rank, any layout (pipeline: the only way); rank 0 writes
    model = adapters.load_adapter(base, "adapter/", is_trainable=True)   # any peft adapter, sliced on load
"""
from __future__ import annotations

import importlib

_LAZY = {
    "lora_config": "lora",
    "register_parallel_layers": "lora",
    "ParallelLoraLinear": "lora",
    "adapter_state_dict": "saving",
    "save_adapter": "saving",
    "load_adapter": "lora",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
