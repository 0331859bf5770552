"""Auto classes: dispatch on ``config.model_type`` to this project's model classes, or to ``transformers``' own.

Each Auto class has a task (``AutoModelForCausalLM.task == "causal_lm"``); the class for a model type is the one
its family record names for that task (``models/registry.py``: the records of the family folders, plus those added
with ``oslo_models.register_family``). A family's model code is imported when one of its models is first built.
A type with no record for the task is built by the generic path (``oslo_models/generic``): ``transformers``' own
class for it, loaded shard by shard and trained with the same helpers. Only a type that ``transformers`` has no
class for either is "Unsupported".
"""
from __future__ import annotations

import os

from transformers import AutoConfig, PretrainedConfig

from . import registry


class _AutoModel:
    task: str = "base"

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is built with from_pretrained(...) or from_config(...)")

    @classmethod
    def model_class_for(cls, config: PretrainedConfig) -> type:
        """The class for ``config.model_type`` and this Auto class's task: the native one when a family record has
        it, else ``transformers``' own (the generic path); ``ValueError`` ("Unsupported model type ...", with the
        supported types) when neither has one."""
        from ..generic.support import transformers_class

        try:
            return registry.model_class(cls.task, config.model_type, owner=cls.__name__)
        except ValueError as error:
            generic = transformers_class(cls.task, config)
            if generic is None:
                raise ValueError(f"{error} (natively), and transformers has no {cls.__name__} class for it "
                                 f"either") from None
            return generic

    @classmethod
    def _is_generic(cls, model_class: type) -> bool:
        """A ``transformers`` class (the generic path) rather than an ``oslo_models`` one (which has a plan)."""
        return not hasattr(model_class, "parallel_plan")

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
        if cls._is_generic(model_class):
            from ..generic.loading import from_pretrained
            return from_pretrained(model_class, pretrained_model_name_or_path, parallel=parallel, revision=revision,
                                   token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                                   subfolder=subfolder, **kwargs)
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
        if cls._is_generic(model_class):
            from ..generic.loading import from_config
            return from_config(model_class, config, parallel=parallel, **kwargs)
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
