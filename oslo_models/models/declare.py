"""A new stack family from a config class and a ``StackSpec``: the model classes are declared, not written.

``declare_stack_family`` makes the classes a Hub model type needs on an existing family's code (``like``: that
family's ``PreTrainedModel``, whose base model builds the layers from the spec's components and the family's hooks):

    class ToyConfig(transformers.LlamaConfig):
        model_type = "toy"

    TOY_SPEC = dataclasses.replace(LLAMA_SPEC)                  # or other components / block / names
    globals().update(declare_stack_family(
        "Toy", ToyConfig, TOY_SPEC, like=LlamaPreTrainedModel, module=__name__,
        hf_twins={"base": transformers.LlamaModel, "causal_lm": transformers.LlamaForCausalLM}))
    FAMILIES = (FamilyRecord(model_type="toy", package=__name__, config="ToyConfig",
                             classes={"base": "ToyModel", "causal_lm": "ToyForCausalLM"}, spec="TOY_SPEC"),)

It returns ``{name: class}``: ``{prefix}PreTrainedModel`` (the config class and the spec), ``{prefix}Model`` (the
shared stack) and one generic head per task of ``hf_twins`` (``models/heads.py``). Each class's ``hf_twin`` is the
``transformers`` class with the same module tree (used to initialize ``from_config`` exactly as ``transformers``
would); the plan, the divisibility checks and the pipeline stages are derived from the spec.
"""
from __future__ import annotations

from typing import Mapping

from transformers.generation import GenerationMixin

from .heads import ForCausalLM, ForQuestionAnswering, ForSequenceClassification, ForTokenClassification

HEADS = {"causal_lm": ("ForCausalLM", ForCausalLM),
         "sequence_classification": ("ForSequenceClassification", ForSequenceClassification),
         "token_classification": ("ForTokenClassification", ForTokenClassification),
         "question_answering": ("ForQuestionAnswering", ForQuestionAnswering)}


def declare_stack_family(prefix: str, config_class: type, spec, *, like: type, hf_twins: Mapping[str, type],
                         module: str, **attributes) -> dict[str, type]:
    """The classes of a new family (see the module docstring). ``attributes`` go to the ``PreTrainedModel`` (e.g.
    ``decoder_options`` overrides, ``base_model_prefix``)."""
    unknown = sorted(set(hf_twins) - {"base", *HEADS})
    if "base" not in hf_twins or unknown:
        raise ValueError(f"hf_twins needs 'base' and tasks among {sorted(HEADS)}; got {sorted(hf_twins)}")
    common = {"__module__": module}
    pretrained = type(f"{prefix}PreTrainedModel", (like,),
                      {**common, "config_class": config_class, "stack_spec": spec, **attributes})
    base = type(f"{prefix}Model", (pretrained, like.base_model_class), {**common, "hf_twin": hf_twins["base"]})
    pretrained.base_model_class = base
    classes = {pretrained.__name__: pretrained, base.__name__: base}
    for task, twin in hf_twins.items():
        if task == "base":
            continue
        suffix, head = HEADS[task]
        bases = (head, pretrained, GenerationMixin) if task == "causal_lm" else (head, pretrained)
        classes[prefix + suffix] = type(prefix + suffix, bases, {**common, "hf_twin": twin})
    return classes
