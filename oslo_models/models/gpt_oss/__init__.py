"""gpt-oss: attention sinks, alternating sliding/full layers and a biased, clamped-SwiGLU MoE on the Mixtral code
(``modeling_gpt_oss.py``)."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports

# gpt-oss's tiny model: layer 0 sliding (window 3, shorter than the test sequences), layer 1 full; sinks (drawn by
# transformers' init) in every softmax; q/k/v/o biases; 4 experts, top-2, router bias; swiglu_limit 0.02, below the
# spread of the gate/up activations, so the clamps act on both sides. Router logits and the aux loss on.
TINY_GPT_OSS = dict(
    vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
    layer_types=["sliding_attention", "full_attention"], swiglu_limit=0.02, swiglu_alpha=1.702,
    max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.3, pad_token_id=0,
    bos_token_id=1, eos_token_id=2, attention_bias=True,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False})
FAMILIES = (
    FamilyRecord(model_type="gpt_oss", package=__name__, config="GptOssConfig",
                 classes=decoder_classes("GptOss", WITHOUT_QA),
                 tiny_config=TINY_GPT_OSS, spec="GPT_OSS_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
