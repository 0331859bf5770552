from .configuration_llama import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from .modeling_llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    LlamaPreTrainedModel,
)
from .parallel_plan import LLAMA_BASE_PLAN, LLAMA_HEAD_PLAN, LLAMA_LM_PLAN, LLAMA_QA_PLAN, decoder_plan
from .pipeline_llama import LlamaPipelineAdapter

__all__ = ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "LlamaDecoderLayer", "LlamaForCausalLM",
           "LlamaForQuestionAnswering", "LlamaForSequenceClassification", "LlamaForTokenClassification", "LlamaModel",
           "LlamaPreTrainedModel", "LLAMA_BASE_PLAN", "LLAMA_HEAD_PLAN", "LLAMA_LM_PLAN", "LLAMA_QA_PLAN",
           "decoder_plan", "LlamaPipelineAdapter"]
