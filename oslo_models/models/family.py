"""One record per model type: what the Auto classes, ``oslo_models``' public names and the test zoo read.

A family folder (``models/llama``, ``models/roberta``, ...) declares its model types in its ``__init__.py``::

    FAMILIES = (
        FamilyRecord(model_type="llama", package=__name__, config="LlamaConfig",
                     classes={"base": "LlamaModel", "causal_lm": "LlamaForCausalLM", ...},
                     tiny_config=dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, ...)),
    )
    __getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_llama": ["LlamaDecoderLayer"]})

The export table is derived from the records (:func:`record_exports`): the config class from
``configuration_<folder>``, the model classes, ``<Prefix>PreTrainedModel`` and the spec from ``modeling_<folder>``;
only what lives elsewhere is written out.

The record names classes by string and the package exports them lazily (PEP 562), so collecting the records
(``models.registry``) imports no model code and no torch; the classes are imported when first asked for. Adding a
family touches only its own folder. Out-of-tree model types are added at run time with
``oslo_models.register_family(record)``.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

# the Auto classes' tasks (``AutoModelForCausalLM.task == "causal_lm"``, ...), in the order the Auto classes appear
TASKS = ("base", "causal_lm", "sequence_classification", "masked_lm", "pretraining", "seq2seq_lm",
         "token_classification", "question_answering", "text_encoding", "multiple_choice", "next_sentence_prediction")


@dataclass(frozen=True)
class FamilyRecord:
    """What this project knows about one ``config.model_type``.

    Args:
        model_type: the Hugging Face ``config.model_type`` (``"llama"``, ``"xlm-roberta"``).
        package: absolute module path whose attributes are the names below (``"oslo_models.models.llama"``).
        config: name of the config class in ``package``.
        classes: task (one of :data:`TASKS`) -> model class name in ``package``.
        tiny_config: config keyword arguments of the tiny model the test zoo builds (``tests/helpers/zoo.py``):
            small (hidden 16-64, 2-4 layers, vocab about 60-101), head counts divisible by 4 so tp 2 and 4 work.
        spec: name of the family's block spec object in ``package``; ``None`` while the family has none.
    """

    model_type: str
    package: str
    config: str
    classes: Mapping[str, str] = field(hash=False)
    tiny_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    spec: str | None = None

    def __post_init__(self):
        unknown = sorted(set(self.classes) - set(TASKS))
        if unknown:
            raise ValueError(f"{self.model_type!r}: unknown task(s) {unknown}; tasks are {list(TASKS)}")
        # read-only views, so a record cannot change after it is registered
        object.__setattr__(self, "classes", MappingProxyType(dict(self.classes)))
        object.__setattr__(self, "tiny_config", MappingProxyType(dict(self.tiny_config)))

    def _resolve(self, name: str):
        return getattr(importlib.import_module(self.package), name)

    def config_class(self) -> type:
        """The config class (imports the family's configuration module)."""
        return self._resolve(self.config)

    def model_class(self, task: str) -> type:
        """The model class for ``task`` (imports the family's model code); ``KeyError`` if it has none."""
        return self._resolve(self.classes[task])

    def main_task(self) -> str:
        """The task of the class that stands for the type (its masked LM for an encoder, else its causal or
        seq2seq LM, else the base model): what ``om.capabilities(type)`` and the support matrix ask."""
        return next(task for task in ("masked_lm", "seq2seq_lm", "causal_lm", "base", *TASKS) if task in self.classes)

    def stack_spec(self):
        """The family's ``StackSpec`` (``models/common/stack/stack.py``), or ``None`` for a family without one."""
        return self._resolve(self.spec) if self.spec else None

    def public_names(self) -> tuple[str, ...]:
        """The names ``oslo_models`` exports for this model type: the config class, then the model classes."""
        return tuple(dict.fromkeys((self.config, *self.classes.values())))


#: the tasks of the generic stack heads (``models/heads.py``), in the order a decoder's record lists them
STACK_TASKS = ("base", "causal_lm", "sequence_classification", "token_classification", "question_answering")
#: the same without the span head (Gemma 1/2, Phi, Phi-3, StarCoder2, DeepSeek-V3, gpt-oss)
WITHOUT_QA = STACK_TASKS[:4]
_STACK_SUFFIXES = dict(zip(STACK_TASKS, ("Model", "ForCausalLM", "ForSequenceClassification",
                                         "ForTokenClassification", "ForQuestionAnswering")))


def decoder_classes(prefix: str, tasks: tuple[str, ...] = STACK_TASKS) -> dict[str, str]:
    """A decoder record's ``classes``: task -> ``{prefix}Model``, ``{prefix}ForCausalLM``,
    ``{prefix}ForSequenceClassification``, ``{prefix}ForTokenClassification``, ``{prefix}ForQuestionAnswering`` for
    ``tasks`` (``transformers``' names of the generic heads; the family's modeling file writes each class out)."""
    return {task: prefix + _STACK_SUFFIXES[task] for task in tasks}


#: the tasks of the masked-LM encoders' heads (``models/encoder_heads.py``), in the order an encoder's record lists them
ENCODER_TASKS = ("base", "masked_lm", "pretraining", "sequence_classification", "token_classification",
                 "question_answering", "multiple_choice")
#: the same without a pre-training head (DeBERTa-v2, DistilBERT, ModernBERT)
WITHOUT_PRETRAINING = tuple(task for task in ENCODER_TASKS if task != "pretraining")
_ENCODER_SUFFIXES = {**_STACK_SUFFIXES, "masked_lm": "ForMaskedLM", "pretraining": "ForPreTraining",
                     "multiple_choice": "ForMultipleChoice"}


def encoder_classes(prefix: str, tasks: tuple[str, ...] = ENCODER_TASKS) -> dict[str, str]:
    """An encoder record's ``classes``: task -> ``{prefix}Model``, ``{prefix}ForMaskedLM``, ``{prefix}ForPreTraining``,
    ``{prefix}ForSequenceClassification``, ``{prefix}ForTokenClassification``, ``{prefix}ForQuestionAnswering``,
    ``{prefix}ForMultipleChoice`` for ``tasks`` (``transformers``' names; the modeling file writes each class out)."""
    return {task: prefix + _ENCODER_SUFFIXES[task] for task in tasks}


def lazy_exports(package: str, table: Mapping[str, list[str]]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for a package whose public names are imported on first use (PEP 562).

    ``table`` maps a module path relative to ``package`` (``".modeling_llama"``, ``"..llama.configuration_llama"``)
    to the names it defines; a name equal to the module's own last component (``".data": ["data"]``) is the module
    itself. The package's submodules resolve too (``package.modeling_llama`` without importing it first), as they
    did when the ``__init__`` imported them. A name is looked up once, then cached in the package's namespace."""
    where = {name: module for module, names in table.items() for name in names}
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")  # the import binds it in the package
        imported = importlib.import_module(module, package)
        value = imported if module.rsplit(".", 1)[-1] == name else getattr(imported, name)
        namespace[name] = value  # later lookups are plain attribute reads
        return value

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__


def record_exports(package: str, records: tuple[FamilyRecord, ...], also: Mapping[str, list[str]] | None = None,
                   others: str | None = None, config_from: str | None = None,
                   spec_from: str | None = None) -> dict[str, list[str]]:
    """The export table (module relative to ``package`` -> names) of a family folder, derived from its records.

    The first record is the folder's own type: its config class comes from ``.configuration_<folder>``; its model
    classes, ``<Prefix>PreTrainedModel`` (``Prefix``: what its class names share, ``Llama``, ``GPT2``, ``Gemma3``)
    and its spec from ``.modeling_<folder>``. ``config_from`` / ``spec_from`` name another family folder whose
    ``configuration_<it>`` / ``modeling_<it>`` holds the config class / the spec (Qwen2's are Llama's). The records
    after the first (the same code under other names: XLM-RoBERTa and CamemBERT, mT5) have their config and model
    classes in ``others``. ``also`` names what lives elsewhere or is exported besides (extra heads, layer classes,
    a plan): a name it lists moves to its module there, and a module it adds comes after the derived ones."""
    folder = package.rsplit(".", 1)[-1]
    first, *rest = records
    configuration = f"..{config_from}.configuration_{config_from}" if config_from else f".configuration_{folder}"
    modeling = f".modeling_{folder}"
    prefix = os.path.commonprefix(list(first.classes.values()))
    table: dict[str, list[str]] = {configuration: [first.config],
                                   modeling: [*first.classes.values(), f"{prefix}PreTrainedModel"]}
    if first.spec:
        table.setdefault(f"..{spec_from}.modeling_{spec_from}" if spec_from else modeling, []).append(first.spec)
    if rest:
        table[others] = [name for record in rest for name in (record.config, *record.classes.values())]
    moved = {name for names in (also or {}).values() for name in names}
    table = {module: [name for name in names if name not in moved] for module, names in table.items()}
    for module, names in (also or {}).items():
        table.setdefault(module, []).extend(names)
    return {module: list(dict.fromkeys(names)) for module, names in table.items() if names}


def family_exports(package: str, records: tuple[FamilyRecord, ...], also: Mapping[str, list[str]] | None = None,
                   others: str | None = None, config_from: str | None = None,
                   spec_from: str | None = None) -> tuple[Callable, Callable, list[str]]:
    """``(__getattr__, __dir__, __all__)`` of a family folder's ``__init__``: :func:`lazy_exports` of the table
    :func:`record_exports` derives from ``records`` (with ``also``, ``others``, ``config_from``, ``spec_from``),
    and every name it lists, in order. One line per family::

        __getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
    """
    table = record_exports(package, records, also, others, config_from, spec_from)
    return (*lazy_exports(package, table), [name for names in table.values() for name in names])
