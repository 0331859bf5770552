"""What the generic path can do for a ``transformers`` model type, decided from its config alone.

A model type with no family record is trained as ``transformers``' own class (``generic/loading.py``). What that
class supports is read from ``transformers`` itself, never from a table kept here:

- tensor parallelism: the config's ``base_model_tp_plan`` (plus the class's own ``_tp_plan`` entries for its head),
  applied by ``transformers``' DTensor styles on the ``tp`` axis of the model's DeviceMesh. A type with no plan runs
  data parallel only.
- pipeline parallelism: causal LMs, cut at the decoder's layers (``base_model_pp_plan``'s, or the repeated
  ``_no_split_modules`` blocks of a type without one) and run by the native models' schedules
  (``pipeline_cut.py``, ``pipeline_stage.py``), with data parallelism, ZeRO 0-3, tensor and sequence parallelism,
  context parallelism and expert parallelism; a load-balancing loss (``output_router_logits``) carries its routing
  statistics from stage to stage (``router_loss.py``; under cp summed over the cp ranks). Refused with the reason:
  other tasks.
- data parallelism, ZeRO 1/2/3, CPU offload, mixed precision, gradient clipping and resumable checkpoints need
  nothing from the model and always apply; activation checkpointing is ``transformers``' own
  (``gradient_checkpointing_enable``), i.e. ``activation_checkpointing="full"``.
- sequence parallelism: built from the plan's regions and the module tree at load (``sequence_parallel.py``, which
  refuses a layer it cannot split, with the reason); it needs tensor parallelism.
- context parallelism: causal LMs whose layers attend through ``transformers``' attention interface
  (``context_parallel.py``, checked at load with the reason).
- expert parallelism: ``transformers``' own ``base_model_ep_plan`` over the ``ep`` part of ``dp x cp``
  (``expert_parallel.py``), with tensor (and sequence) parallelism, context parallelism and ZeRO 0-3.
- the 2D / 2.5D / 3D tensor modes need the native layers: refused.

:func:`check_parallel` raises before any process group exists, so a request the path cannot honour is a clear
``ValueError`` naming the type and what it supports, never a hang or a silently different layout.
"""
from __future__ import annotations

# oslo task -> the transformers Auto class whose mapping names the class for a config type
AUTO_CLASS_OF_TASK = {
    "base": "AutoModel", "causal_lm": "AutoModelForCausalLM", "masked_lm": "AutoModelForMaskedLM",
    "sequence_classification": "AutoModelForSequenceClassification", "pretraining": "AutoModelForPreTraining",
    "seq2seq_lm": "AutoModelForSeq2SeqLM", "token_classification": "AutoModelForTokenClassification",
    "question_answering": "AutoModelForQuestionAnswering", "text_encoding": "AutoModelForTextEncoding",
    "multiple_choice": "AutoModelForMultipleChoice", "next_sentence_prediction": "AutoModelForNextSentencePrediction",
    "image_text_to_text": "AutoModelForImageTextToText",
}
# projections whose colwise split cuts attention heads (transformers' names across its models)
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "query", "key", "value")
_CHECKPOINTING_MODES = ("full",)

DATA_PARALLEL_FEATURES = ("data parallelism (DDP over the dp axis), ZeRO 1/2/3 (FSDP2 units from _no_split_modules "
                          "or the repeated blocks), CPU offload, activation_checkpointing='full', mixed precision, "
                          "gradient clipping, resumable checkpoints, save_pretrained / push_to_hub")


def transformers_class(task: str, config) -> type | None:
    """``transformers``' class for ``config``'s type and ``task`` (the one its Auto class builds), or ``None``."""
    import transformers

    auto = getattr(transformers, AUTO_CLASS_OF_TASK[task])
    mapping = auto._model_mapping  # transformers' lazy {config class: model class} table, read-only here
    try:
        found = mapping[type(config)]
    except (KeyError, ValueError):
        return None
    return found[0] if isinstance(found, (list, tuple)) else found


def tensor_parallel_plan(config, model_class: type | None = None) -> dict[str, str]:
    """The tensor-parallel plan ``transformers`` would apply: the config's ``base_model_tp_plan`` (under the base
    model's prefix when ``model_class`` is a head class) plus ``model_class._tp_plan`` (e.g. ``lm_head``). Empty when
    the type has no base plan: a head's entry alone does not make a type tensor parallel."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = dict(getattr(text, "base_model_tp_plan", None) or {})
    if not base:
        return {}
    prefix = getattr(model_class, "base_model_prefix", "") if model_class is not None else ""
    plan = {f"{prefix}.{key}" if prefix else key: style for key, style in base.items()}
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    return plan


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def pipeline_plan(config) -> dict:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_pp_plan", None) or {})


def is_image_text(config, model_class: type | None) -> bool:
    """Whether ``model_class`` is ``transformers``' image-text class for ``config`` (its
    ``AutoModelForImageTextToText`` mapping): pipelined and context parallel like a causal LM around its decoder,
    with the vision side on the first stage / on every cp rank (``oslo_models/image_text``)."""
    return model_class is not None and transformers_class("image_text_to_text", config) is model_class


def _causal(config, model_class: type | None) -> bool:
    return model_class is None or model_class.__name__.endswith("ForCausalLM") or is_image_text(config, model_class)


def _splits_heads(plan: dict[str, str]) -> bool:
    return any(key.rsplit(".", 1)[-1] in _HEAD_PROJECTIONS and style == "colwise" for key, style in plan.items())


def refusals(config, parallel, model_class: type | None = None) -> list[str]:
    """Why ``parallel`` (a ``ParallelConfig``) cannot run ``config``'s type on the generic path: one sentence per
    request it cannot honour (empty when it can). Reads only the configs: no model, no collective."""
    model_type = config.model_type
    reasons = []
    tp = parallel.tensor_parallel_size
    plan = tensor_parallel_plan(config, model_class)
    if tp > 1 and not plan:
        reasons.append(f"tensor_parallel_size={tp}: {model_type!r} has no native family in oslo_models and "
                       f"transformers gives it no tensor-parallel plan (config.base_model_tp_plan), so it runs data "
                       f"parallel only; use tensor_parallel_size=1")
    if tp > 1 and plan and _splits_heads(plan):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for name in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(text, name, None)
            if isinstance(heads, int) and heads % tp:
                reasons.append(f"{name}={heads} is not divisible by tensor_parallel_size={tp}: transformers' plan for "
                               f"{model_type!r} splits whole heads over the tensor-parallel ranks (no replication on "
                               f"the generic path)")
    if parallel.tensor_parallel_mode != "1d":
        reasons.append(f"tensor_parallel_mode={parallel.tensor_parallel_mode!r}: the 2D/2.5D/3D grids need the "
                       f"native layers; the generic path applies transformers' 1D plan")
    if parallel.sequence_parallel and (tp == 1 or not plan):
        reasons.append("sequence_parallel=True: sequence parallelism splits the sequence between the tensor-parallel "
                       "regions of the type's plan, so it needs tensor_parallel_size > 1 and a base_model_tp_plan")
    reasons += pipeline_refusals(config, parallel, model_class)
    cp = parallel.context_parallel_size
    if cp > 1 and not _causal(config, model_class):
        reasons.append(f"context_parallel_size={cp}: the generic path splits the sequence of causal LMs (through "
                       f"transformers' attention interface); {model_class.__name__} is not one")
    elif cp > 1 and not isinstance(getattr(text_config(config), "num_attention_heads", None), int):
        reasons.append(f"context_parallel_size={cp}: {model_type!r} has no attention heads "
                       f"(config.num_attention_heads) for the context-parallel attention to split across chunks")
    ep = parallel.expert_parallel_size
    if ep > 1 and not getattr(text_config(config), "base_model_ep_plan", None):
        reasons.append(f"expert_parallel_size={ep}: transformers gives {model_type!r} no expert-parallel plan "
                       f"(base_model_ep_plan), so the generic path has no experts to split")
    asked = [f"{name}={getattr(parallel, name)!r}" for name in ("tiled_mlp", "activation_offload", "tiled_loss")
             if getattr(parallel, name)]
    if asked:  # built into the native stack's blocks and heads (models/common/stack/long_sequence.py)
        reasons.append(f"{', '.join(asked)}: the long-sequence tools (sequence-tiled MLP, activation offload, tiled "
                       f"loss) are built into the native families' blocks and heads; the generic path runs "
                       f"transformers' own modules, which have none of them (use activation_checkpointing='full')")
    mode = parallel.activation_checkpointing
    if mode is not None and mode not in _CHECKPOINTING_MODES:
        reasons.append(f"activation_checkpointing={mode!r}: the generic path has transformers' own checkpointing "
                       f"of whole layers only ('full')")
    return reasons


def pipeline_refusals(config, parallel, model_class: type | None = None) -> list[str]:
    """Why ``parallel`` cannot pipeline ``config``'s type on the generic path (empty when it can, or at pp 1)."""
    pp = parallel.pipeline_parallel_size
    if pp == 1:
        return []
    head = f"pipeline_parallel_size={pp}: "
    if model_class is None and transformers_class("causal_lm", config) is None:
        return [head + f"the generic path pipelines causal LMs (a decoder's layers cut into stages); transformers "
                       f"has no causal LM class for {config.model_type!r}"]
    if not _causal(config, model_class):
        return [head + f"the generic path pipelines causal LMs (a decoder's layers cut into stages); "
                       f"{model_class.__name__} is not one"]
    reasons = []
    return reasons


def check_parallel(config, parallel, model_class: type | None = None) -> None:
    """``ValueError`` naming the type, every request the generic path cannot honour, and what it does support.
    Call before any process group exists."""
    reasons = refusals(config, parallel, model_class)
    if reasons:
        plan = tensor_parallel_plan(config, model_class)
        supported = DATA_PARALLEL_FEATURES + (", tensor parallelism over its base_model_tp_plan" if plan else "")
        raise ValueError(f"{config.model_type!r} runs on the generic path (transformers' own "
                         f"{getattr(model_class, '__name__', 'model class')}), which cannot honour: "
                         + "; ".join(reasons) + f". It supports: {supported}.")

