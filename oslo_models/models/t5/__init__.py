from .configuration_t5 import T5Config
from .modeling_t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model, T5PreTrainedModel
from .heads_t5 import T5ForQuestionAnswering, T5ForSequenceClassification, T5ForTokenClassification
from .parallel_plan import T5_PLAN

__all__ = ["T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel", "T5PreTrainedModel", "T5_PLAN"]
__all__ += ["T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"]
