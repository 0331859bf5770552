from .configuration_t5 import T5Config
from .modeling_t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model, T5PreTrainedModel
from .heads_t5 import T5ForQuestionAnswering, T5ForSequenceClassification, T5ForTokenClassification
from .mt5 import MT5Config, MT5EncoderModel, MT5ForConditionalGeneration, MT5Model
from .parallel_plan import T5_PLAN

__all__ = ["T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel", "T5PreTrainedModel", "T5_PLAN"]
__all__ += ["MT5Config", "MT5Model", "MT5ForConditionalGeneration", "MT5EncoderModel"]
__all__ += ["T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"]
