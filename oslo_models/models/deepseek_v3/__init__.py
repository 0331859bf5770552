"""DeepSeek-V3: multi-head latent attention and a grouped-top-k MoE with shared experts on the Mixtral code
(``modeling_deepseek_v3.py``)."""
from ..family import WITHOUT_QA, FamilyRecord, decoder_classes, family_exports

# DeepSeek-V3's tiny model: layer 0 dense (first_k_dense_replace=1), layer 1 sparse; 8 routed experts in 4 groups,
# the best 2 groups kept (topk_group < n_group), top-2 of those, renormalized and scaled by 2.5; one shared expert.
# MLA with a low-rank query (q_lora_rank; the plain q_proj is the family test's), values narrower than keys
# (v_head_dim 6 vs 8 + 4), yarn rotary whose mscale_all_dim changes the score scale. Router logits on.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=61, hidden_size=32, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    max_position_embeddings=64, output_router_logits=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
FAMILIES = (
    FamilyRecord(model_type="deepseek_v3", package=__name__, config="DeepseekV3Config",
                 classes=decoder_classes("DeepseekV3", WITHOUT_QA),
                 tiny_config=TINY_DEEPSEEK_V3, spec="DEEPSEEK_V3_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
