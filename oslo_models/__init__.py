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
from .models.auto import AutoModelForMultipleChoice, AutoModelForNextSentencePrediction
from .models.bert import BertForMultipleChoice, BertForNextSentencePrediction, BertLMHeadModel
from .models.gpt2 import GPT2ForQuestionAnswering, GPT2ForTokenClassification
from .models.roberta import RobertaForCausalLM, RobertaForMultipleChoice
from .models.t5 import T5ForQuestionAnswering, T5ForSequenceClassification, T5ForTokenClassification
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
__all__ += ["AutoModelForMultipleChoice", "AutoModelForNextSentencePrediction", "BertLMHeadModel",
            "BertForMultipleChoice", "BertForNextSentencePrediction", "GPT2ForTokenClassification",
            "GPT2ForQuestionAnswering", "RobertaForCausalLM", "RobertaForMultipleChoice",
            "T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"]
