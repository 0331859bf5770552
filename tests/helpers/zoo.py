"""The test zoo: one tiny model per model type, read from the family records (``FamilyRecord.tiny_config``,
declared in ``oslo_models/models/<family>/__init__.py``). A new family's tests get its tiny model from its record.

``tiny_config("llama")`` is ``transformers``' own config class (``transformers.LlamaConfig``) with the record's
values, so the reference model of a parity test is plain ``transformers``; a model type ``transformers`` does not
know (one registered with ``om.register_family``) gets the record's config class. A test that needs other sizes
passes them as overrides next to its use: ``tiny_config("gpt2", n_layer=4)``.
"""
from __future__ import annotations

import copy

import transformers

from oslo_models.models.registry import families, family_record


def model_types() -> tuple[str, ...]:
    """Every model type with a record (the in-tree families, then any registered at run time)."""
    return tuple(record.model_type for record in families())


def tiny_kwargs(model_type: str, **overrides) -> dict:
    """The record's tiny config values (a fresh copy) updated with ``overrides``."""
    return {**copy.deepcopy(dict(family_record(model_type).tiny_config)), **overrides}


def tiny_config(model_type: str, **overrides) -> transformers.PretrainedConfig:
    """``transformers``' config of the tiny ``model_type`` model, with ``overrides``."""
    values = tiny_kwargs(model_type, **overrides)
    if model_type in transformers.CONFIG_MAPPING:
        return transformers.AutoConfig.for_model(model_type, **values)
    return family_record(model_type).config_class()(**values)


def class_prefix(model_type: str) -> str:
    """The family's class name prefix (``"Qwen2"`` for ``"qwen2"``): its config class name without ``Config``."""
    return family_record(model_type).config.removesuffix("Config")
