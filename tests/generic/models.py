"""Tiny models of types that have no native family, each different from the others, for the generic path's tests.

Hidden 64, 2 layers, vocabulary 101, no dropout. Each exercises something of its own:

- granite: decoder with a ``base_model_tp_plan`` (colwise/rowwise heads and MLP), GQA, scaling multipliers.
- cohere: decoder with a plan, tied embeddings (the vocab-split embedding is the head), parallel block, logit scale.
- olmoe: mixture of experts with a plan (fused experts ``packed_colwise`` + ``moe_tp_experts``, gathered q/k/v);
  its checkpoint stores one tensor per expert, which ``transformers`` fuses on load.
- stablelm: decoder without a plan, partial rotary, LayerNorm.
- mpt: decoder without a plan, ALiBi, tied embeddings.
- mamba: a state space model (no attention), nested ``_no_split_modules`` (``MambaBlock`` > ``MambaMixer``).
- megatron-bert: masked-LM encoder, tied decoder, no ``_no_split_modules`` (FSDP2 units: the repeated layers).
- xglm: decoder without a plan, sinusoidal positions, scaled tied embeddings.
- apertus (2025): a learnable activation (xIELU: two scalars per layer) between the colwise ``up_proj`` and the
  rowwise ``down_proj``, named by no plan entry, and per-head ``q_norm`` / ``k_norm`` (plan:
  ``replicated_with_grad_allreduce``): replicated parameters whose gradient is partial over tp
  (``generic/partial_gradients.py``).
- llama4_text (2025): MoE (top-1 sigmoid router, fused experts) in layer 1 with a shared expert whose rowwise output the
  model adds the routed experts into in place (``out.add_``), a dense MLP in layer 0, chunked attention, QK L2 norm
  (``generic/inplace_outputs.py``).
- cohere2 (2025): sliding-window layers (window 4) interleaved with full attention, tied embeddings, logit scale.
- qwen3_next (2025): hybrid decoder, a gated DeltaNet (linear attention) layer before an attention layer, MoE.
- dots1 (2025): a dense first layer, then MoE with DeepSeek's grouped sigmoid router (score-correction bias) and a
  shared expert.
- minimax_m2 (2025): MoE in every layer, sigmoid router with a score-correction bias, no shared expert.
- hunyuan_v1_moe (2025): MoE with a softmax top-k router and a shared MLP, QK norm.
- vaultgemma (2025): Gemma 2's attention logit soft-capping (cap 2, so it bites) on sliding and full layers.
- granite_swa (2026): a learned attention sink per head in every layer, sliding-window layers.
- granitemoehybrid (2025, Granite 4): hybrid decoder, a Mamba-2 layer before an attention layer, MoE (softmax top-k
  router) plus a shared MLP in every layer; no ``base_model_pp_plan``; its plan names only the experts.
- lfm2_moe (2025, LFM2-MoE): hybrid decoder, a gated short-convolution layer before an attention layer, a dense
  first layer then MoE (sigmoid router with an expert bias), tied embeddings; no ``base_model_pp_plan``.
- glm4_moe (2025, GLM-4.5): a dense first layer, then MoE with a grouped sigmoid router (score-correction bias) and
  shared experts inside the plan's regions, partial rotary.
- ernie4_5_moe (2025, ERNIE 4.5): MoE from layer 1 with a softmax router whose top-k is picked on bias-corrected
  scores (the bias in a module of its own), shared experts, tied embeddings.
- exaone4 (2025, EXAONE 4): post-norm layers (norms after attention / MLP), per-head QK norm, a sliding-window layer
  (window 4) before a global one.
- smollm3 (2025, SmolLM3): NoPE layers (every 2nd layer without rotary positions), tied embeddings.
- olmo3 (2025, Olmo 3): sliding-window (window 4) and full layers, QK norm over all heads (the plan gathers q/k/v
  whole: no head-split region).
"""
from __future__ import annotations

import os

import torch
import transformers

_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS = {
    "granite": lambda: transformers.GraniteConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
        attention_multiplier=0.2, max_position_embeddings=64, **_IDS),
    "cohere": lambda: transformers.CohereConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, logit_scale=0.5, max_position_embeddings=64, tie_word_embeddings=True, **_IDS),
    "olmoe": lambda: transformers.OlmoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, max_position_embeddings=64, **_IDS),
    "stablelm": lambda: transformers.StableLmConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, partial_rotary_factor=0.5, max_position_embeddings=64, **_IDS),
    "mpt": lambda: transformers.MptConfig(vocab_size=101, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2,
                                          max_seq_len=64, **_IDS),
    "mamba": lambda: transformers.MambaConfig(vocab_size=101, hidden_size=64, num_hidden_layers=2, state_size=8,
                                              expand=2, **_IDS),
    "megatron-bert": lambda: transformers.MegatronBertConfig(
        vocab_size=101, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64, pad_token_id=0),
    "xglm": lambda: transformers.XGLMConfig(
        vocab_size=101, d_model=64, num_layers=2, attention_heads=4, ffn_dim=96, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, max_position_embeddings=64, **_IDS),
    "apertus": lambda: transformers.ApertusConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        **_IDS),
    "llama4_text": lambda: transformers.Llama4TextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, interleave_moe_layer_step=2,
        max_position_embeddings=64, **_IDS),
    "cohere2": lambda: transformers.Cohere2Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64, **_IDS),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        max_position_embeddings=64, **_IDS),
    "dots1": lambda: transformers.Dots1Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, **_IDS),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(
        vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        **_IDS),
    "hunyuan_v1_moe": lambda: transformers.HunYuanMoEV1Config(
        vocab_size=101, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, moe_topk=2, max_position_embeddings=64, eod_token_id=3,
        sep_token_id=4, **_IDS),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
        vocab_size=101, hidden_size=64, intermediate_size=32, shared_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=8, mamba_expand=2, max_position_embeddings=64, **_IDS),
    "lfm2_moe": lambda: transformers.Lfm2MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
        layer_types=["conv", "full_attention"], max_position_embeddings=64, **_IDS),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64, **_IDS),
    "ernie4_5_moe": lambda: transformers.Ernie4_5_MoeConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
        moe_layer_start_index=1, max_position_embeddings=64, **_IDS),
    "exaone4": lambda: transformers.Exaone4Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, sliding_window_pattern=2, max_position_embeddings=64, **_IDS),
    "smollm3": lambda: transformers.SmolLM3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, no_rope_layer_interval=2, max_position_embeddings=64, **_IDS),
    "olmo3": lambda: transformers.Olmo3Config(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64, **_IDS),
    "vaultgemma": lambda: transformers.VaultGemmaConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
        max_position_embeddings=64, **_IDS),
    "granite_swa": lambda: transformers.GraniteSWAConfig(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=64, **_IDS),
}
MASKED_LM = {"megatron-bert"}


def auto_class(name: str, library=transformers):
    """The Auto class of the model's task, from ``transformers`` or ``oslo_models``."""
    return library.AutoModelForMaskedLM if name in MASKED_LM else library.AutoModelForCausalLM


def save(root, names) -> dict[str, str]:
    """Save each named tiny model (seed 0) under ``root/name`` in Hub format."""
    paths = {}
    for name in names:
        torch.manual_seed(0)
        path = os.path.join(str(root), name)
        auto_class(name).from_config(CONFIGS[name]()).save_pretrained(path)
        paths[name] = path
    return paths
