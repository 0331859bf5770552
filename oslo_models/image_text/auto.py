"""``AutoModelForImageTextToText``: an image-text model (LLaVA, LLaVA-NeXT, Gemma 3, Qwen2.5-VL, Qwen3-VL,
Mistral 3, Idefics3, SmolVLM, ...) as ``transformers``' own class, each rank holding its shard.

    model = om.AutoModelForImageTextToText.from_pretrained(path, parallel=om.ParallelConfig(
        tensor_parallel_size=2, zero_stage=3), freeze_vision=True)

The type is built by the generic path (``oslo_models/generic``, ``transformers``' class for the config from its
``AutoModelForImageTextToText`` mapping): the language model is split by ``transformers``' own plan (the nested
``language_model`` / ``text_model`` entries of the class's ``tp_plan``, the LM head colwise with the
vocabulary-parallel loss), the vision tower and projector are replicated on every tp rank (``vision.py``: no type
has a vision plan in ``transformers`` 5.24; their gradients are whole on every rank), and data parallelism and ZeRO
0-3 come from ``training.prepare`` / ``training.shard_data_parallel`` as for any model (FSDP2 units from the class's
``_no_split_modules``, vision blocks included).

Batches are what the model's processor returns (``input_ids`` with the image tokens expanded, ``pixel_values``,
``image_grid_thw`` / ``image_sizes`` / ``pixel_attention_mask``, Qwen's ``mm_token_type_ids``, Gemma 3's
``token_type_ids``): each data-parallel rank passes its rows and their images. The forward runs exactly as in
``transformers`` (image features merged at the image tokens, Qwen's M-RoPE positions computed from the grid);
collectives: the plan's (all-reduces over tp in the decoder's rowwise projections, the loss's three all-reduces of
``[tokens]``), none in the vision tower.

``freeze_vision=True``: the vision tower and projector get ``requires_grad=False`` at load (no gradient, no optimizer
state); the language model (and LM head) train.

Pipeline parallelism (``pipeline.py``): the language model's layers cut into stages, the vision tower and projector
on the first stage, with tensor and data parallelism and ZeRO 0-3; ``model.train_step(batch)`` runs the schedule.
Context parallelism (``context_parallel.py``): every cp rank merges the whole rows' image features, the merged
sequence is split before the language model (batches: :func:`~oslo_models.image_text.context_parallel_splitter`).

Not implemented, refused before any process group with the reason (:func:`refusals`): pipeline parallelism with
context parallelism (untested), expert parallelism and sequence parallelism (not tested for these
classes). Under context parallelism a type whose language model takes precomputed masks (Gemma 3) is refused at load.
"""
from __future__ import annotations

import os

from ..models.auto import _AutoModel
from . import vision

TASK = "image_text_to_text"


class AutoModelForImageTextToText(_AutoModel):
    task = TASK

    @classmethod
    def model_class_for(cls, config) -> type:
        """``transformers``' ``AutoModelForImageTextToText`` class for ``config``'s type; ``ValueError`` if none."""
        from ..generic.support import transformers_class

        found = transformers_class(TASK, config)
        if found is None:
            raise ValueError(f"Unsupported model type {config.model_type!r} for {cls.__name__}: transformers has no "
                             f"AutoModelForImageTextToText class for it")
        return found

    @classmethod
    def check_parallel(cls, parallel) -> None:
        """``NotImplementedError`` naming each axis of ``parallel`` (a ``ParallelConfig`` / ``ParallelContext`` /
        ``None``) this class cannot run yet (:func:`refusals`); no collective."""
        reasons = refusals(parallel)
        if reasons:
            raise NotImplementedError(f"{cls.__name__}: " + "; ".join(reasons))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, parallel=None,
                        freeze_vision: bool = False, **kwargs):
        """As :meth:`oslo_models.AutoModelForCausalLM.from_pretrained` (``parallel``, ``dtype``, hub arguments,
        config overrides); ``freeze_vision``: see the module docstring. Collective: every rank calls it."""
        cls.check_parallel(parallel)
        model = super().from_pretrained(pretrained_model_name_or_path, parallel=parallel, **kwargs)
        return _finish(model, freeze_vision)

    @classmethod
    def from_config(cls, config, *, parallel=None, freeze_vision: bool = False, **kwargs):
        """A randomly initialized model for ``config`` (seed every rank alike first), sliced for this rank."""
        cls.check_parallel(parallel)
        return _finish(super().from_config(config, parallel=parallel, **kwargs), freeze_vision)


def refusals(parallel) -> list[str]:
    """One sentence per axis of ``parallel`` that image-text models do not run on yet (empty when all run)."""
    config = getattr(parallel, "config", parallel)
    if config is None:
        return []
    reasons = []
    pp, cp = config.pipeline_parallel_size, config.context_parallel_size
    if pp > 1 and cp > 1:
        reasons.append(f"pipeline_parallel_size={pp} with context_parallel_size={cp} is not implemented (untested) "
                       f"for image-text models: pipeline them with tensor and data parallelism (ZeRO 0-3)")
    if config.expert_parallel_size > 1:
        reasons.append(f"expert_parallel_size={config.expert_parallel_size} is not implemented (untested) for "
                       f"image-text models")
    if config.sequence_parallel:
        reasons.append("sequence_parallel=True is not implemented (untested) for image-text models: the image "
                       "features are merged into whole sequences")
    return reasons


def _finish(model, freeze: bool):
    if not isinstance(freeze, bool):
        raise ValueError(f"freeze_vision must be True or False, got {freeze!r}")
    vision.vision_parameter_names(model)  # a clear error for a class with no separate language model
    if freeze:
        vision.freeze_vision(model)
    return model
