"""Llama and the Llama-shaped decoders' shared code (Mistral, Qwen2 and Qwen3 are thin classes over it, in their own
folders; their config classes live in ``configuration_llama``).

Names are imported on first use (PEP 562): importing this package, as ``models.registry`` does to read
``FAMILIES``, imports no model code."""
from ..family import FamilyRecord, lazy_exports

_EXPORTS = {
    ".configuration_llama": ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config"],
    ".modeling_llama": ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaForQuestionAnswering",
                        "LlamaForSequenceClassification", "LlamaForTokenClassification", "LlamaModel",
                        "LlamaPreTrainedModel", "LLAMA_SPEC"],
}
# The tiny Llama-shaped decoders of the tests share these sizes: grouped-query attention with 8 query / 2 key-value
# heads (tp=4 replicates key/value heads), vocab 101 (odd: the vocab-parallel layers pad it).
TINY_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, rms_norm_eps=1e-6)


_HEADS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
_TASKS = ("base", "causal_lm", "sequence_classification", "token_classification", "question_answering")


def decoder_record(model_type: str, package: str, prefix: str, **switches) -> FamilyRecord:
    """The record of a Llama-shaped decoder: ``{prefix}Config`` and the five classes ``{prefix}Model``,
    ``{prefix}ForCausalLM``, ...; its tiny config is :data:`TINY_DECODER` with the family's ``switches``."""
    return FamilyRecord(model_type=model_type, package=package, config=f"{prefix}Config",
                        classes={task: prefix + head for task, head in zip(_TASKS, _HEADS)},
                        tiny_config={**TINY_DECODER, **switches}, spec="LLAMA_SPEC")


def thin_decoder_package(package: str, model_type: str, prefix: str, **switches):
    """``(FAMILIES, __getattr__, __dir__, __all__)`` of a thin decoder folder (Mistral, Qwen2, Qwen3): its config
    class from ``llama/configuration_llama.py``, its classes from ``modeling_<model_type>.py`` (the five heads and
    ``{prefix}PreTrainedModel``), exported lazily."""
    exports = {"..llama.configuration_llama": [f"{prefix}Config"], "..llama.modeling_llama": ["LLAMA_SPEC"],
               f".modeling_{model_type}": [prefix + head for head in (*_HEADS, "PreTrainedModel")]}
    return ((decoder_record(model_type, package, prefix, **switches),), *lazy_exports(package, exports),
            [name for names in exports.values() for name in names])


# Llama's tiny model: biases on q/k/v/o and the MLP, untied embeddings
FAMILIES = (decoder_record("llama", __name__, "Llama", attention_bias=True, mlp_bias=True),)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = [name for names in _EXPORTS.values() for name in names]
