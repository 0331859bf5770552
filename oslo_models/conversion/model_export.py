"""``save_pretrained`` / ``push_to_hub`` of a native or generic model through the distributed writer (``hub_export``):
one path. ``model.save_pretrained`` (native models), ``om.training.save_pretrained`` (any model, any wrapper) and
both ``push_to_hub`` calls end in :func:`save_hub_folder`: every rank writes its share, nothing is gathered.

The model says what it holds (``export_pieces``: the plan's layouts for a native model, DTensor placements for a
generic one) and which Hub keys its tensors become (``hub_keys``); the writer does the rest, the same for both.
The configs are what each path wrote before: a native model's ``config.json`` with ``architectures`` set to its
class and ``dtype`` to the saved weights' dtype; a generic model's as ``transformers``' ``save_pretrained`` writes
it (its ``distributed_config`` dropped), and ``generation_config.json`` for models that generate.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile

from .hub_export import DEFAULT_BUFFER_BYTES, export_hub_folder


def _class_name(model) -> str:
    return type(model).__name__.removeprefix("FSDP")  # FSDP2 renames the class of the modules it wraps


def hub_configs(model, generic: bool):
    """``(config, generation config or None)`` as the Hub folder gets them (copies; ``dtype`` is set on write)."""
    config = copy.deepcopy(model.config)
    if generic and hasattr(config, "distributed_config"):
        del config.distributed_config
    config.architectures = [_class_name(model)]
    return config, copy.deepcopy(model.generation_config) if model.can_generate() else None


def _config_writer(model, generic: bool):
    config, generation_config = hub_configs(model, generic)

    def write(folder: str, floating_dtypes) -> None:
        dtypes = sorted(floating_dtypes, key=str)
        if len(dtypes) == 1 or (generic and dtypes):
            config.dtype = dtypes[0] if len(dtypes) == 1 else model.dtype
        config.save_pretrained(folder)
        if generation_config is not None:
            generation_config.save_pretrained(folder)

    return write


def export_model(model, save_directory, *, max_shard_size="5GB", buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> dict:
    """Write ``model`` (native or generic, unwrapped from DDP; FSDP2 and pipeline stages as they are) as a plain
    Hub folder, every rank writing its share. Collective. Returns this rank's statistics (``hub_export``)."""
    from ..generic import is_generic
    from .export_pieces import generic_entries, native_entries
    from .hub_keys import convert_whole

    generic = is_generic(model)
    return export_hub_folder(model.parallel_context, (lambda: generic_entries(model)) if generic else
                             (lambda: native_entries(model)), save_directory,
                             write_configs=_config_writer(model, generic), max_shard_size=max_shard_size,
                             buffer_bytes=buffer_bytes, convert=lambda name, full: convert_whole(model, name, full))


def save_hub_folder(model, save_directory, *, max_shard_size="5GB", buffer_bytes: int | None = None,
                    what: str = "save_pretrained") -> dict:
    """The one Hub save: check the options (a ``ValueError`` before any collective), check that every rank arrived
    (``what`` names the call in the error), then :func:`export_model`. ``model``: unwrapped from DDP. Collective.
    Returns this rank's ``{"bytes", "planned_bytes", "seconds"}``."""
    from ..distributed.agreement import check_arrival
    from .hub_export import check_options
    from .saving import SAVE_RULE

    buffer_bytes = DEFAULT_BUFFER_BYTES if buffer_bytes is None else buffer_bytes
    check_options(save_directory, max_shard_size, buffer_bytes)
    check_arrival(model.parallel_context, what, SAVE_RULE)
    return export_model(model, save_directory, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes)


def _shared_staging(context, staging_dir) -> str:
    """A new empty folder made by global rank 0 (in ``staging_dir``, else its temporary folder) that every rank
    sees; a ``ValueError`` on every rank when some rank does not see it (it is removed first)."""
    from ..distributed.agreement import agree_on_failure

    folder, error = None, None
    if context.rank == 0:
        try:
            folder = tempfile.mkdtemp(prefix="oslo-push-", dir=staging_dir)
        except Exception as caught:  # noqa: BLE001 - raised on every rank below
            error = caught
    folder = agree_on_failure(context, error, what="push_to_hub (creating the staging folder)", value=folder)[0]
    sees = agree_on_failure(context, None, what="push_to_hub", value=os.path.isdir(folder))
    blind = [rank for rank, seen in enumerate(sees) if not seen]
    if blind:
        if context.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise ValueError(f"push_to_hub writes the folder from every rank, and rank(s) {blind} do not see rank 0's "
                         f"staging folder {folder!r}: pass staging_dir= a folder on a file system every rank sees")
    return folder


def push_hub_folder(model, repo_id: str, *, private=None, token=None, commit_message: str = "Upload model",
                    revision=None, max_shard_size="5GB", buffer_bytes: int | None = None, staging_dir=None):
    """:func:`save_hub_folder` into a staging folder every rank sees (made by global rank 0 in ``staging_dir``, else
    in its temporary folder), every rank writing its share; once every rank is done (the save's last agreement),
    global rank 0 uploads it (``huggingface_hub.HfApi.upload_folder``) while the others wait, and removes it.
    Collective. Returns rank 0's upload result on rank 0, ``None`` elsewhere."""
    from .hub_export import check_sizes
    from .saving import run_on_main_process

    context = model.parallel_context
    check_sizes(max_shard_size, DEFAULT_BUFFER_BYTES if buffer_bytes is None else buffer_bytes)
    root = _shared_staging(context, staging_dir)
    try:
        folder = os.path.join(root, "model")
        save_hub_folder(model, folder, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes,
                        what="push_to_hub")

        def upload():
            from huggingface_hub import HfApi

            api = HfApi(token=token)
            api.create_repo(repo_id, private=private, exist_ok=True)
            return api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message,
                                     revision=revision)

        return run_on_main_process(context, upload, what=f"push_to_hub({repo_id!r})")  # the others wait
    finally:
        if context.rank == 0:
            _remove_staging(root)


def _remove_staging(root: str, attempts: int = 5) -> None:
    """Remove the push's staging folder, checking that it is gone rather than trusting ``rmtree``'s errors (an entry
    that vanishes while it walks raises ``FileNotFoundError`` with the rest left behind: seen once in CI, the folder
    left empty); retried, then a warning naming what is left: never a silent leftover."""
    import time
    import warnings

    for attempt in range(attempts):
        shutil.rmtree(root, ignore_errors=True)
        if not os.path.lexists(root):
            return
        time.sleep(0.05 * (attempt + 1))
    left = sorted(os.listdir(root)) if os.path.isdir(root) else []
    warnings.warn(f"push_to_hub could not remove its staging folder {root!r} (left: {left})", RuntimeWarning,
                  stacklevel=3)
