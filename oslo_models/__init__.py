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
from .models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from .models.mistral import (
    MistralConfig,
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
)
from .models.qwen2 import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)
from .models.qwen3 import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
)
from .models.mixtral import MixtralConfig, MixtralForCausalLM, MixtralModel
from .models.qwen2_moe import Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen2MoeModel
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
__all__ += [f"{family}{suffix}" for family in ("Llama", "Mistral", "Qwen2", "Qwen3")
            for suffix in ("Config", "Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
                           "ForQuestionAnswering")]
__all__ += ["MixtralConfig", "MixtralModel", "MixtralForCausalLM", "Qwen2MoeConfig", "Qwen2MoeModel",
            "Qwen2MoeForCausalLM"]
