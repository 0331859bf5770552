"""XLM-RoBERTa and CamemBERT: RoBERTa's architecture and Hub keys under their own ``model_type``.

``transformers`` gives them their own config classes (``XLMRobertaConfig``, ``CamembertConfig``; same fields as
``RobertaConfig``) and model classes (``XLMRobertaForMaskedLM``, ...; same module tree, ``roberta.*`` keys). Here
each is the RoBERTa class with that config class and that ``transformers`` twin, under the twin's class name, so a
checkpoint loads with its own config class and ``save_pretrained`` writes its own ``model_type`` and
``architectures`` (plain ``transformers`` then loads it as what it was). Plans, pipeline adapters, shapes and
collectives are RoBERTa's.
"""
from __future__ import annotations

import transformers

from .modeling_roberta import (
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
)
from .parallel_plan import published_tp_plan


class XLMRobertaConfig(transformers.XLMRobertaConfig):
    base_model_tp_plan = published_tp_plan()


class CamembertConfig(transformers.CamembertConfig):
    base_model_tp_plan = published_tp_plan()


# ---------------------------------------------------------------------------------------------- XLM-RoBERTa
class XLMRobertaModel(RobertaModel):
    config_class = XLMRobertaConfig
    hf_twin = transformers.XLMRobertaModel


class XLMRobertaForMaskedLM(RobertaForMaskedLM):
    config_class = XLMRobertaConfig
    hf_twin = transformers.XLMRobertaForMaskedLM


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    config_class = XLMRobertaConfig
    hf_twin = transformers.XLMRobertaForSequenceClassification


class XLMRobertaForTokenClassification(RobertaForTokenClassification):
    config_class = XLMRobertaConfig
    hf_twin = transformers.XLMRobertaForTokenClassification


class XLMRobertaForQuestionAnswering(RobertaForQuestionAnswering):
    config_class = XLMRobertaConfig
    hf_twin = transformers.XLMRobertaForQuestionAnswering


# ---------------------------------------------------------------------------------------------- CamemBERT
class CamembertModel(RobertaModel):
    config_class = CamembertConfig
    hf_twin = transformers.CamembertModel


class CamembertForMaskedLM(RobertaForMaskedLM):
    config_class = CamembertConfig
    hf_twin = transformers.CamembertForMaskedLM


class CamembertForSequenceClassification(RobertaForSequenceClassification):
    config_class = CamembertConfig
    hf_twin = transformers.CamembertForSequenceClassification


class CamembertForTokenClassification(RobertaForTokenClassification):
    config_class = CamembertConfig
    hf_twin = transformers.CamembertForTokenClassification


class CamembertForQuestionAnswering(RobertaForQuestionAnswering):
    config_class = CamembertConfig
    hf_twin = transformers.CamembertForQuestionAnswering
