"""Llama and the Llama-shaped decoders' shared code (Mistral, Qwen2 and Qwen3 are thin classes over it, in their own
folders; their config classes live in ``configuration_llama``)."""
from ..family import FamilyRecord, decoder_classes, family_exports

# The tiny Llama-shaped decoders of the tests share these sizes: grouped-query attention with 8 query / 2 key-value
# heads (tp=4 replicates key/value heads), vocab 101 (odd: the vocab-parallel layers pad it).
TINY_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                    eos_token_id=2, rms_norm_eps=1e-6)


def decoder_exports(model_type: str, prefix: str) -> dict[str, list[str]]:
    """The export table of a thin Llama-shaped decoder folder (Mistral, Qwen2, Qwen3): its config class from
    ``configuration_llama``, ``LLAMA_SPEC``, and its classes from ``modeling_<model_type>``."""
    return {"..llama.configuration_llama": [f"{prefix}Config"], "..llama.modeling_llama": ["LLAMA_SPEC"],
            f".modeling_{model_type}": [*decoder_classes(prefix).values(), f"{prefix}PreTrainedModel"]}


# Llama's tiny model: biases on q/k/v/o and the MLP, untied embeddings
FAMILIES = (FamilyRecord(model_type="llama", package=__name__, config="LlamaConfig", spec="LLAMA_SPEC",
                         classes=decoder_classes("Llama"),
                         tiny_config={**TINY_DECODER, "attention_bias": True, "mlp_bias": True}),)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={
    ".configuration_llama": ["MistralConfig", "Qwen2Config", "Qwen3Config"], ".modeling_llama": ["LlamaDecoderLayer"]})
