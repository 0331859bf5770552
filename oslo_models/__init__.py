"""oslo-models: Hugging Face Transformers-compatible models with parallelism built in.

    import oslo_models as om
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=om.ParallelConfig(tensor_parallel_size=2))

Names are imported on first use (PEP 562), as ``transformers`` does: ``import oslo_models`` costs about what
``import transformers`` costs, and a script (or ``python -m oslo_models --help``) pays for torch, the model code and
``torch.distributed.pipelining`` only when it touches them.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

__all__ = [
    "data", "training",
    "ParallelConfig", "ParallelContext", "data_parallel",
    "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
    "GPT2Config", "GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification",
    "AutoModelForMaskedLM", "AutoModelForPreTraining", "AutoModelForSeq2SeqLM", "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering", "AutoModelForTextEncoding",
    "BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification",
    "BertForTokenClassification", "BertForQuestionAnswering",
    "RobertaConfig", "RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
    "RobertaForTokenClassification", "RobertaForQuestionAnswering",
    "T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel",
]
__all__ += ["pipeline"]

# submodule -> the public names it defines (a name listed under its own subpackage is that subpackage)
_LAZY = {
    ".data": ["data"],
    ".training": ["training"],
    ".pipeline": ["pipeline"],
    ".config": ["ParallelConfig"],
    ".distributed": ["ParallelContext", "data_parallel"],
    ".models.auto": ["AutoModel", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForPreTraining",
                     "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
                     "AutoModelForTextEncoding", "AutoModelForTokenClassification"],
    ".models.bert": ["BertConfig", "BertForMaskedLM", "BertForPreTraining", "BertForQuestionAnswering",
                     "BertForSequenceClassification", "BertForTokenClassification", "BertModel"],
    ".models.gpt2": ["GPT2Config", "GPT2ForSequenceClassification", "GPT2LMHeadModel", "GPT2Model"],
    ".models.roberta": ["RobertaConfig", "RobertaForMaskedLM", "RobertaForQuestionAnswering",
                        "RobertaForSequenceClassification", "RobertaForTokenClassification", "RobertaModel"],
    ".models.t5": ["T5Config", "T5EncoderModel", "T5ForConditionalGeneration", "T5Model"],
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


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


if TYPE_CHECKING:  # what static analysis and IDEs see; at run time __getattr__ imports these on first use
    from . import data, pipeline, training
    from .config import ParallelConfig
    from .distributed import ParallelContext, data_parallel
    from .models.auto import (
        AutoModel,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForPreTraining,
        AutoModelForQuestionAnswering,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        AutoModelForTextEncoding,
        AutoModelForTokenClassification,
    )
    from .models.bert import (
        BertConfig,
        BertForMaskedLM,
        BertForPreTraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForTokenClassification,
        BertModel,
    )
    from .models.gpt2 import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
    from .models.roberta import (
        RobertaConfig,
        RobertaForMaskedLM,
        RobertaForQuestionAnswering,
        RobertaForSequenceClassification,
        RobertaForTokenClassification,
        RobertaModel,
    )
    from .models.t5 import T5Config, T5EncoderModel, T5ForConditionalGeneration, T5Model
