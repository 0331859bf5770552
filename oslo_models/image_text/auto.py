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

Not on this path (refused before any process group, with the reason): pipeline and context parallelism
(``generic/support.py``: the generic pipeline cuts causal LMs, context parallelism splits causal LMs' sequences).
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
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, parallel=None,
                        freeze_vision: bool = False, **kwargs):
        """As :meth:`oslo_models.AutoModelForCausalLM.from_pretrained` (``parallel``, ``dtype``, hub arguments,
        config overrides); ``freeze_vision``: see the module docstring. Collective: every rank calls it."""
        model = super().from_pretrained(pretrained_model_name_or_path, parallel=parallel, **kwargs)
        return _finish(model, freeze_vision)

    @classmethod
    def from_config(cls, config, *, parallel=None, freeze_vision: bool = False, **kwargs):
        """A randomly initialized model for ``config`` (seed every rank alike first), sliced for this rank."""
        return _finish(super().from_config(config, parallel=parallel, **kwargs), freeze_vision)


def _finish(model, freeze: bool):
    if not isinstance(freeze, bool):
        raise ValueError(f"freeze_vision must be True or False, got {freeze!r}")
    vision.vision_parameter_names(model)  # a clear error for a class with no separate language model
    if freeze:
        vision.freeze_vision(model)
    return model
