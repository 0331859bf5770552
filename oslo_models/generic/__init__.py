"""The generic path: any ``transformers`` model type without a native family trains with the same helpers.

``om.AutoModelFor*.from_pretrained`` returns the native class when a family record has one for the task, and
otherwise ``transformers``' own class, loaded shard by shard (``loading.py``), tensor parallel through the type's
own ``base_model_tp_plan`` (DTensor on the ``tp`` axis of the model's DeviceMesh) where it has one, and checked
before any process group against what the path supports (``support.py``). The training helpers
(``om.training.prepare`` / ``shard_data_parallel``, ``clip_grad_norm_``, ``save_checkpoint`` /
``load_checkpoint``, ``save_pretrained`` / ``push_to_hub``) ask it the model protocol (``utils/model_protocol.py``),
answered here by ``protocol.py`` (FSDP2 units, ``layout == "placements"``: its DTensors say how each parameter is
split, which ``training/clip_placements.py`` and ``training/dtensor_data_parallel.py`` read); ``checkpoint.py``
(DCP, resharding at any layout) and ``saving.py`` (a plain Hub folder written by ``transformers``' own
``save_pretrained``) serve the checkpoint and export code. At load, ``inplace_outputs.py`` and
``partial_gradients.py`` fix what ``transformers``' inference plans miss in training. ``om.capabilities`` says, for a
native or a generic type, which axes and features apply and why not the others (``capabilities.py``).
"""
from __future__ import annotations


def is_generic(model) -> bool:
    """Whether ``model`` (possibly inside DDP) is a ``transformers`` model loaded by the generic path."""
    inner = getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model
    from .install_state import installed_on

    record = installed_on(inner)
    return record is not None and record.tp_plan is not None
