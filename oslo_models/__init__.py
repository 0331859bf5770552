"""oslo-models: Hugging Face Transformers-compatible models with parallelism built in.

    import oslo_models as om
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=om.ParallelConfig(tensor_parallel_size=2))

Names are imported on first use (PEP 562), as ``transformers`` does: ``import oslo_models`` costs about what
``import transformers`` costs, and a script (or ``python -m oslo_models --help``) pays for torch, the model code and
``torch.distributed.pipelining`` only when it touches them. ``_LAZY`` is the one list of public names.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"


def _family(prefix: str, *suffixes: str) -> list[str]:
    return [prefix + suffix for suffix in suffixes]


_DECODER_HEADS = ("Config", "Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
                  "ForQuestionAnswering")

# submodule -> the public names it defines (a name listed under its own subpackage is that subpackage)
_LAZY = {
    ".data": ["data"],
    ".training": ["training"],
    ".pipeline": ["pipeline"],
    ".config": ["ParallelConfig"],
    ".distributed": ["ParallelContext", "data_parallel"],
    ".models.auto": ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForPreTraining",
                     "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
                     "AutoModelForTextEncoding", "AutoModelForTokenClassification", "AutoModelForMultipleChoice",
                     "AutoModelForNextSentencePrediction"],
    ".models.bert": _family("Bert", "Config", "Model", "ForMaskedLM", "ForPreTraining", "ForQuestionAnswering",
                            "ForSequenceClassification", "ForTokenClassification", "ForMultipleChoice",
                            "ForNextSentencePrediction", "LMHeadModel"),
    ".models.gpt2": _family("GPT2", "Config", "Model", "LMHeadModel", "ForSequenceClassification",
                            "ForTokenClassification", "ForQuestionAnswering"),
    ".models.roberta": [*_family("Roberta", "Config", "Model", "ForMaskedLM", "ForQuestionAnswering",
                                 "ForSequenceClassification", "ForTokenClassification", "ForCausalLM",
                                 "ForMultipleChoice"),
                        # same architecture, own model_type: see models/roberta/variants.py
                        *_family("XLMRoberta", "Config", "Model", "ForMaskedLM", "ForSequenceClassification",
                                 "ForTokenClassification", "ForQuestionAnswering"),
                        *_family("Camembert", "Config", "Model", "ForMaskedLM", "ForSequenceClassification",
                                 "ForTokenClassification", "ForQuestionAnswering")],
    ".models.t5": [*_family("T5", "Config", "Model", "EncoderModel", "ForConditionalGeneration",
                            "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"),
                   *_family("MT5", "Config", "Model", "EncoderModel", "ForConditionalGeneration")],
    ".models.llama": _family("Llama", *_DECODER_HEADS),
    ".models.mistral": _family("Mistral", *_DECODER_HEADS),
    ".models.qwen2": _family("Qwen2", *_DECODER_HEADS),
    ".models.qwen3": _family("Qwen3", *_DECODER_HEADS),
    ".models.mixtral": _family("Mixtral", "Config", "Model", "ForCausalLM"),
    ".models.qwen2_moe": _family("Qwen2Moe", "Config", "Model", "ForCausalLM"),
    ".models.switch_transformers": _family("SwitchTransformers", "Config", "Model", "ForConditionalGeneration",
                                           "EncoderModel"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    imported = importlib.import_module(module, __name__)
    value = imported if module == "." + name else getattr(imported, name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
