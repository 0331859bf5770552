"""oslo-models: Hugging Face Transformers-compatible models with parallelism built in.

    import oslo_models as om
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=om.ParallelConfig(tensor_parallel_size=2))

Names are imported on first use (PEP 562), as ``transformers`` does: ``import oslo_models`` costs about what
``import transformers`` costs, and a script (or ``python -m oslo_models --help``) pays for torch, the model code and
``torch.distributed.pipelining`` only when it touches them. ``_LAZY`` lists the public names outside the model
families; each family's names (its config and model classes) come from its record (``models/<family>/__init__.py``,
``FAMILIES``), read on the first lookup of a name that is not in ``_LAZY``.
"""
from __future__ import annotations

import functools
import importlib

__version__ = "0.1.0"

# submodule -> the public names it defines, besides the families' (a name listed under its own subpackage is that
# subpackage)
_LAZY = {
    ".data": ["data"],
    ".training": ["training"],
    ".losses": ["losses"],
    ".post_training": ["post_training"],
    ".pipeline": ["pipeline"],
    ".config": ["ParallelConfig"],
    ".distributed": ["distributed", "ParallelContext", "data_parallel"],
    ".models.auto": ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForPreTraining",
                     "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
                     "AutoModelForTextEncoding", "AutoModelForTokenClassification", "AutoModelForMultipleChoice",
                     "AutoModelForNextSentencePrediction"],
    ".models.family": ["FamilyRecord"],
    ".models.registry": ["register_family"],
    ".image_text": ["AutoModelForImageTextToText"],
    ".generic.capabilities": ["capabilities"],
    ".planner": ["planner", "plan"],
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


@functools.cache
def _family_names() -> dict[str, str]:
    """Each in-tree family's public name -> the absolute path of the package that exports it."""
    from .models.registry import in_tree_families

    return {name: record.package for record in in_tree_families() for name in record.public_names()}


def __getattr__(name: str):
    if name == "__all__":
        value = sorted({*_WHERE, *_family_names()})
    elif name in _WHERE:
        module = _WHERE[name]
        imported = importlib.import_module(module, __name__)
        value = imported if module == "." + name else getattr(imported, name)
    elif name in _family_names():
        value = getattr(importlib.import_module(_family_names()[name]), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE) | set(_family_names()))
