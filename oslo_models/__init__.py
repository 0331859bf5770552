"""oslo-models: Hugging Face Transformers-compatible models with parallelism built in.

    import oslo_models as om
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=om.ParallelConfig(tensor_parallel_size=2))
"""
from . import data, training
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
from .models.roberta import (  # same architecture, own model_type: see models/roberta/variants.py
    CamembertConfig,
    CamembertForMaskedLM,
    CamembertModel,
    XLMRobertaConfig,
    XLMRobertaForMaskedLM,
    XLMRobertaForSequenceClassification,
    XLMRobertaModel,
)
from .models.t5 import MT5Config, MT5EncoderModel, MT5ForConditionalGeneration, MT5Model
from . import pipeline  # noqa: E402  pipeline parallelism: partitioning, runner, schedule plot

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
__all__ += ["XLMRobertaConfig", "XLMRobertaModel", "XLMRobertaForMaskedLM", "XLMRobertaForSequenceClassification",
            "CamembertConfig", "CamembertModel", "CamembertForMaskedLM",
            "MT5Config", "MT5Model", "MT5ForConditionalGeneration", "MT5EncoderModel"]
