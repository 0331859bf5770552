"""oslo-models: Hugging Face Transformers-compatible models with parallelism built in.

    import oslo_models as om
    model = om.AutoModelForCausalLM.from_pretrained("gpt2", parallel=om.ParallelConfig(tensor_parallel_size=2))
"""
from . import data
from .config import ParallelConfig
from .distributed import ParallelContext, data_parallel
from .models.auto import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
from .models.gpt2 import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, GPT2Model

__version__ = "0.1.0"

__all__ = [
    "data",
    "ParallelConfig", "ParallelContext", "data_parallel",
    "AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
    "GPT2Config", "GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification",
]
