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
from .llama import (
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)
from .mistral import (
    MistralForCausalLM,
    MistralForQuestionAnswering,
    MistralForSequenceClassification,
    MistralForTokenClassification,
    MistralModel,
)
from .mixtral import MixtralForCausalLM, MixtralModel
from .qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeModel
from . import switch_transformers as _switch
from .qwen2 import (
    Qwen2ForCausalLM,
    Qwen2ForQuestionAnswering,
    Qwen2ForSequenceClassification,
    Qwen2ForTokenClassification,
    Qwen2Model,
)
from .qwen3 import (
    Qwen3ForCausalLM,
    Qwen3ForQuestionAnswering,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
    Qwen3Model,
)
from .roberta import (
    RobertaForMaskedLM,
    RobertaForQuestionAnswering,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
    RobertaModel,
)
from .t5 import T5EncoderModel, T5ForConditionalGeneration, T5Model
from .roberta import variants as _roberta_variants
from .t5 import mt5 as _mt5
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
# The Llama-shaped decoders (models/llama; Mistral, Qwen2, Qwen3 are thin classes over it).
for _type, _classes in {
    "llama": (LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification, LlamaForTokenClassification,
              LlamaForQuestionAnswering),
    "mistral": (MistralModel, MistralForCausalLM, MistralForSequenceClassification, MistralForTokenClassification,
                MistralForQuestionAnswering),
    "qwen2": (Qwen2Model, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForTokenClassification,
              Qwen2ForQuestionAnswering),
    "qwen3": (Qwen3Model, Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3ForTokenClassification,
              Qwen3ForQuestionAnswering),
}.items():
    for _task, _class in zip(("base", "causal_lm", "sequence_classification", "token_classification",
                              "question_answering"), _classes):
        MODEL_REGISTRY[_task][_type] = _class

# Mixture-of-experts decoders on the Llama pieces (models/mixtral; Qwen2-MoE is a thin class over it).
for _type, (_base, _lm) in {"mixtral": (MixtralModel, MixtralForCausalLM),
                            "qwen2_moe": (Qwen2MoeModel, Qwen2MoeForCausalLM)}.items():
    MODEL_REGISTRY["base"][_type], MODEL_REGISTRY["causal_lm"][_type] = _base, _lm

# Same architecture as a family above, under the Hub's own model_type, config class and class names.
for _task, _name in (("base", "Model"), ("masked_lm", "ForMaskedLM"), ("sequence_classification",
                     "ForSequenceClassification"), ("token_classification", "ForTokenClassification"),
                    ("question_answering", "ForQuestionAnswering")):
    MODEL_REGISTRY[_task]["xlm-roberta"] = getattr(_roberta_variants, f"XLMRoberta{_name}")
    MODEL_REGISTRY[_task]["camembert"] = getattr(_roberta_variants, f"Camembert{_name}")
MODEL_REGISTRY["base"]["mt5"] = _mt5.MT5Model
MODEL_REGISTRY["seq2seq_lm"]["mt5"] = _mt5.MT5ForConditionalGeneration
MODEL_REGISTRY["text_encoding"]["mt5"] = _mt5.MT5EncoderModel
# Switch Transformers: T5 with sparse (mixture-of-experts) feed-forwards, on the T5 pieces
MODEL_REGISTRY["base"]["switch_transformers"] = _switch.SwitchTransformersModel
MODEL_REGISTRY["seq2seq_lm"]["switch_transformers"] = _switch.SwitchTransformersForConditionalGeneration
MODEL_REGISTRY["text_encoding"]["switch_transformers"] = _switch.SwitchTransformersEncoderModel
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
        """Load a Hub checkpoint (id, cache or local folder) as the ``oslo_models`` class for its ``model_type``,
        sliced for this rank. Call on every rank of the launched world (torchrun / accelerate launch).

        Args:
            pretrained_model_name_or_path: Hub id or folder (safetensors, sharded index or legacy ``.bin``).
            parallel: the layout: ``None`` (one process, no parallelism), an :class:`~oslo_models.ParallelConfig`
                (``tensor_parallel_size``, ``sequence_parallel``, ``pipeline_parallel_size``, ...; checked against
                the model before anything is allocated, the process group is then initialized from the torchrun
                environment if the script has not done it, the rest of the world is data parallelism), or a ready
                :class:`~oslo_models.ParallelContext` to share one context (and its process groups) between models.
                The world must be a multiple of ``tensor_parallel_size x pipeline_parallel_size`` (``ValueError``
                before any collective otherwise).
            dtype: a torch dtype, its name, ``"auto"`` (the checkpoint's) or ``None`` (fp32).
            revision, token, cache_dir, local_files_only, subfolder: as in ``transformers``.
            **kwargs: ``dtype``, ``progress`` (a loading bar), ``config``, and config attributes to override.

        Each rank builds the model on the meta device and reads only its slices, so peak host memory per rank is
        about its shard. The result is in eval mode, like ``transformers``; ``model.parallel_context`` holds the
        context. Collective: every rank calls it (a ``ParallelConfig`` creates the process groups and the device
        mesh here); with pipeline stages, each rank reads only the layers of its own stages.
        """
        config = AutoConfig.from_pretrained(pretrained_model_name_or_path, revision=revision, token=token,
                                            cache_dir=cache_dir, local_files_only=local_files_only,
                                            subfolder=subfolder)
        model_class = cls.model_class_for(config)
        return model_class.from_pretrained(pretrained_model_name_or_path, parallel=parallel, revision=revision,
                                           token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                                           subfolder=subfolder, **kwargs)

    @classmethod
    def from_config(cls, config: PretrainedConfig, *, parallel=None, **kwargs):
        """A randomly initialized model for ``config``'s ``model_type``. ``parallel``: as in
        :meth:`from_pretrained` (``None``, a ``ParallelConfig`` or a ``ParallelContext``). The full weights are drawn
        as ``transformers`` would from the current seed, then sliced: seed every rank alike first
        (``torch.manual_seed``), and every layout starts from the model tp=1 would."""
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
