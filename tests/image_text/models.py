"""Tiny image-text models of the listed types and image-text batches for them, built with ``transformers`` only.

Language model: hidden 64, 2 layers, 4 heads (2 kv heads), vocabulary 101 (ids 96-100 reserved for image tokens);
vision tower: hidden 32, 1-2 layers, 4 heads; images of a few pixels drawn in code. Each type differs:

- llava: CLIP vision tower (CLS token dropped), two-layer GELU projector, Llama decoder; 28x28 image -> 16 tokens.
- llava_next: the same with any-resolution tiling (base tile + one 28x28 tile per grid cell, ``image_sizes``),
  an ``image_newline`` row separator; Mistral decoder.
- gemma3: SigLIP tower, average-pooled to ``mm_tokens_per_image`` = 4 tokens, Gemma 3 decoder (sliding + full layers,
  bidirectional attention inside an image's tokens from ``token_type_ids``).
- qwen2_5_vl: Qwen's windowed vision transformer on flattened patches (``image_grid_thw``), 2x2 patch merger, M-RoPE
  (3-axis positions computed from the grid).
- qwen3_vl: Qwen3-VL's tower (learned position embeddings, deepstack features added into the first decoder layers),
  interleaved M-RoPE, Qwen3 decoder (QK norm).
- mistral3: Pixtral tower (2D RoPE, ``image_sizes``), patch merger, Mistral decoder.
- idefics3 / smolvlm: SigLIP-like tower, pixel-shuffle connector (``scale_factor`` 2), Llama decoder;
  ``pixel_values`` ``[batch, images, 3, H, W]``.
"""
from __future__ import annotations

import os

import torch
import transformers

IMAGE_TOKEN = 100
VISION_START, VISION_END = 98, 99  # Qwen's <|vision_start|> / <|vision_end|>
VOCAB = 101
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, **_IDS)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _text(cls, **extra):
    return {**cls(**_TEXT, **extra).to_dict()}


CONFIGS = {
    "llava": lambda: transformers.LlavaConfig(
        text_config=_text(transformers.LlamaConfig),
        vision_config=dict(model_type="clip_vision_model", image_size=28, patch_size=7, projection_dim=32, **_VISION),
        image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, projector_hidden_act="gelu"),
    "llava_next": lambda: transformers.LlavaNextConfig(
        text_config=_text(transformers.MistralConfig, sliding_window=None),
        vision_config=dict(model_type="clip_vision_model", image_size=28, patch_size=7, projection_dim=32, **_VISION),
        image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, image_grid_pinpoints=[[28, 56], [56, 28]]),
    "gemma3": lambda: transformers.Gemma3Config(
        text_config=dict(model_type="gemma3_text", **_TEXT, head_dim=16, sliding_window=4, layer_types=[
            "sliding_attention", "full_attention"], query_pre_attn_scalar=16),
        vision_config=dict(model_type="siglip_vision_model", image_size=28, patch_size=7, **_VISION),
        mm_tokens_per_image=4, image_token_id=IMAGE_TOKEN, boi_token_index=97, eoi_token_index=98),
    "qwen2_5_vl": lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(**_TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                   "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=4,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE_TOKEN, video_token_id=97, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END),
    "qwen3_vl": lambda: transformers.Qwen3VLConfig(
        text_config=dict(**_TEXT, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                "mrope_section": [2, 3, 3],
                                                                "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        image_token_id=IMAGE_TOKEN, video_token_id=97, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END),
    "mistral3": lambda: transformers.Mistral3Config(
        text_config=_text(transformers.MistralConfig, sliding_window=None, head_dim=16),
        vision_config=dict(model_type="pixtral", image_size=28, patch_size=7, head_dim=8, rope_theta=1e4, **_VISION),
        image_token_index=IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1),
    "idefics3": lambda: transformers.Idefics3Config(
        text_config=_text(transformers.LlamaConfig),
        vision_config=dict(image_size=28, patch_size=7, **_VISION), scale_factor=2, image_token_id=IMAGE_TOKEN),
    "smolvlm": lambda: transformers.SmolVLMConfig(
        text_config=_text(transformers.LlamaConfig),
        vision_config=dict(image_size=28, patch_size=7, **_VISION), scale_factor=2, image_token_id=IMAGE_TOKEN),
}
TYPES = tuple(CONFIGS)


def config(name: str):
    cfg = CONFIGS[name]()
    for sub in (cfg, cfg.get_text_config(), getattr(cfg, "vision_config", None)):
        if sub is not None:
            for key in ("attention_dropout", "dropout", "hidden_dropout", "attention_probs_dropout_prob"):
                if hasattr(sub, key):
                    setattr(sub, key, 0.0)
    return cfg


def build(name: str, seed: int = 0):
    """The single-process ``transformers`` model, weights drawn from ``seed`` (fp32, train mode off)."""
    torch.manual_seed(seed)
    return transformers.AutoModelForImageTextToText.from_config(config(name)).eval()


def save(root, names=TYPES, seed: int = 0) -> dict[str, str]:
    """Save each type's tiny model as a Hub folder under ``root``; returns ``{name: path}``."""
    paths = {}
    for name in names:
        path = os.path.join(str(root), name)
        build(name, seed).save_pretrained(path)
        paths[name] = path
    return paths
