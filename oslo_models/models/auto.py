"""Auto classes: dispatch on ``config.model_type`` to this project's model classes.

``MODEL_REGISTRY[task][model_type]`` is the one table; families add their classes here.
"""
from __future__ import annotations

import os

from transformers import AutoConfig, PretrainedConfig

from .bert import (
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from .gpt2 import GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model
from .roberta import (
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
)
from .t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model
from .bert import BertForMultipleChoice, BertForNextSentencePrediction, BertLMHeadModel
from .gpt2 import GPT2ForQuestionAnswering, GPT2ForTokenClassification
from .roberta import RobertaForCausalLM, RobertaForMultipleChoice
from .t5 import T5ForQuestionAnswering, T5ForSequenceClassification, T5ForTokenClassification

MODEL_REGISTRY: dict[str, dict[str, type]] = {
    "base": {"gpt2": GPT2Model, "bert": BertModel, "roberta": RobertaModel, "t5": T5Model},
    "causal_lm": {"gpt2": GPT2LMHeadModel},
    "sequence_classification": {"gpt2": GPT2ForSequenceClassification, "bert": BertForSequenceClassification,
                                "roberta": RobertaForSequenceClassification},
    "masked_lm": {"bert": BertForMaskedLM, "roberta": RobertaForMaskedLM},
    "pretraining": {"bert": BertForPreTraining},
    "seq2seq_lm": {"t5": T5ForConditionalGeneration},
    "token_classification": {"bert": BertForTokenClassification, "roberta": RobertaForTokenClassification},
    "question_answering": {"bert": BertForQuestionAnswering, "roberta": RobertaForQuestionAnswering},
    "text_encoding": {"t5": T5EncoderModel},
}
# heads of the transformers model contract (issue 21)
MODEL_REGISTRY["causal_lm"].update(bert=BertLMHeadModel, roberta=RobertaForCausalLM)
MODEL_REGISTRY["sequence_classification"].update(t5=T5ForSequenceClassification)
MODEL_REGISTRY["token_classification"].update(gpt2=GPT2ForTokenClassification, t5=T5ForTokenClassification)
MODEL_REGISTRY["question_answering"].update(gpt2=GPT2ForQuestionAnswering, t5=T5ForQuestionAnswering)
MODEL_REGISTRY["multiple_choice"] = {"bert": BertForMultipleChoice, "roberta": RobertaForMultipleChoice}
MODEL_REGISTRY["next_sentence_prediction"] = {"bert": BertForNextSentencePrediction}


class _AutoModel:
    task: str = "base"

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is built with from_pretrained(...) or from_config(...)")

    @classmethod
    def model_class_for(cls, config: PretrainedConfig) -> type:
        table = MODEL_REGISTRY[cls.task]
        if config.model_type not in table:
            raise ValueError(f"Unsupported model type {config.model_type!r} for {cls.__name__}; supported: "
                             f"{sorted(table)}")
        return table[config.model_type]

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *, parallel=None, revision=None,
                        token=None, cache_dir=None, local_files_only: bool = False, subfolder: str = "",
                        **kwargs):
        """Read ``config.json`` (local folder, cache or Hub), then ``<Family>.from_pretrained(...)``."""
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, revision=revision, token=token,
                                            cache_dir=cache_dir, local_files_only=local_files_only,
                                            subfolder=subfolder)
        model_class = cls.model_class_for(config)
        return model_class.from_pretrained(pretrained_model_name_or_path, parallel=parallel, revision=revision,
                                           token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                                           subfolder=subfolder, **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, parallel=None, **kwargs):
        """A randomly initialized model (seed every rank alike first)."""
        model_class = cls.model_class_for(config)
        if not isinstance(config, model_class.config_class):
            config = model_class.config_class.from_dict(config.to_dict())
        return model_class.from_config(config, parallel=parallel, **kwargs)


class AutoModel(_AutoModel):
    task = "base"


class AutoModelForCausalLM(_AutoModel):
    task = "causal_lm"


class AutoModelForSequenceClassification(_AutoModel):
    task = "sequence_classification"


class AutoModelForMaskedLM(_AutoModel):
    task = "masked_lm"


class AutoModelForPreTraining(_AutoModel):
    task = "pretraining"


class AutoModelForSeq2SeqLM(_AutoModel):
    task = "seq2seq_lm"


class AutoModelForTokenClassification(_AutoModel):
    task = "token_classification"


class AutoModelForQuestionAnswering(_AutoModel):
    task = "question_answering"


class AutoModelForTextEncoding(_AutoModel):
    task = "text_encoding"


class AutoModelForMultipleChoice(_AutoModel):
    task = "multiple_choice"


class AutoModelForNextSentencePrediction(_AutoModel):
    task = "next_sentence_prediction"
