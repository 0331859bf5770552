"""The Llama-shaped decoder, written once, single-device, with the module tree and state-dict keys of
``transformers``' Llama; Mistral, Qwen2 and Qwen3 are the same code with other switches (``decoder_options``) and
their own class names (``models/mistral``, ``models/qwen2``, ``models/qwen3``).

What differs between the four, and where it is decided:

- attention biases (Llama ``attention_bias``/``mlp_bias``, Qwen2 q/k/v biases, Qwen3 ``attention_bias``) and
  Qwen3's q/k RMS norms: ``decoder_options(config)``, a class method each family overrides;
- sliding-window attention (Mistral ``sliding_window``, Qwen2/Qwen3 ``use_sliding_window``/``max_window_layers``,
  or ``layer_types``): ``attention_types(config)`` (``common.causal_masks.layer_types``; Mistral overrides it);
- the feed-forward: ``build_mlp(config, layer_idx)`` (SwiGLU here; the hook mixture-of-experts decoders override);
- tied or untied embeddings: ``config.tie_word_embeddings``.

Gemma 1/2/3 and OLMo 2 (their own folders) use the same hooks further: ``decoder_options`` also picks the norm
formula, the attention class, the score scale and the logit soft-cap; ``decoder_layer_class`` a sandwich-norm layer
(``SandwichDecoderLayer``); ``build_rotary`` the rotary module.

The layer is the pre-norm block template (``common/blocks.py``) under Llama's names; the forward is the shared stack
(``common/stack.py``: embeddings, layers, final norm, with the sequence-parallel region opened once per forward);
the parallel plan and the divisibility checks are derived from ``LLAMA_SPEC``'s components; the heads are the
generic ones (``models/heads.py``). Parallelism enters only through the layers the plan swaps in.

Shapes: b batch, s sequence, h hidden, n query heads (n/tp per rank), n_kv key/value heads, d head dim, V vocab.
"""
from __future__ import annotations

import transformers
from torch import nn
from transformers.generation import GenerationMixin

from ...parallel_layers.layers import Embedding
from ..common import GatedMLP, GroupedQueryAttention, RMSNorm, RotaryEmbedding, layer_types
from ..common.blocks import PreNormBlock, SandwichNormBlock
from ..common.capabilities import Capabilities
from ..common.stack import StackSpec, TransformerStack
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_llama import LlamaConfig


class LlamaDecoderLayer(PreNormBlock):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``.
    ``attention_type`` (full or sliding) picks this layer's mask from the stack's ``{type: mask}``; ``mlp`` is the
    family's feed-forward (``build_mlp``: the SwiGLU ``GatedMLP`` here, a mixture-of-experts block in the MoE
    decoders)."""

    names = dict(attn_norm="input_layernorm", attn="self_attn", mlp_norm="post_attention_layernorm", mlp="mlp")

    def __init__(self, config, layer_idx: int, *, options: dict, attention_type: str, mlp: nn.Module,
                 fused: bool = False):
        attention = decoder_attention(config, layer_idx, options, attention_type, fused=fused)
        # registered in transformers' order (self_attn, mlp, input_layernorm, post_attention_layernorm)
        super().__init__(attn=attention, mlp=mlp, attn_norm=decoder_norm(config, options, fused=fused),
                         mlp_norm=decoder_norm(config, options, fused=fused),
                         order=("attn", "mlp", "attn_norm", "mlp_norm"))
        self.attention_type = attention_type


class SandwichDecoderLayer(SandwichNormBlock):
    """The Llama-shaped layer on the sandwich-norm template (``common/blocks.py``): ``x + post_attn_norm(attn(
    attn_norm(x)))``, then the same around the MLP. A family's subclass gives ``transformers``' ``names``; the norms
    it names are built (``decoder_norm``), those it leaves out are skipped: Gemma 2/3 name all four, OLMo 2 only the
    two post norms. Registered as ``transformers`` registers them: ``self_attn``, ``mlp``, then the norms in block
    order."""

    def __init__(self, config, layer_idx: int, *, options: dict, attention_type: str, mlp: nn.Module,
                 fused: bool = False):
        norms = {role: decoder_norm(config, options, fused=fused)
                 for role in self.roles if role.endswith("norm") and role in self.names}
        super().__init__(attn=decoder_attention(config, layer_idx, options, attention_type, fused=fused), mlp=mlp,
                         **norms, order=("attn", "mlp", *norms))
        self.attention_type = attention_type


def decoder_attention(config, layer_idx: int, options: dict, attention_type: str, *, fused: bool = False):
    """Layer ``layer_idx``'s attention from the family's ``decoder_options``: ``attention`` (the class, default
    ``GroupedQueryAttention``), the biases and q/k norms, and, when present, ``scaling`` / ``softcap`` (Gemma 2/3);
    the config's ``sliding_window`` on ``"sliding_attention"`` layers."""
    window = config.sliding_window if attention_type == "sliding_attention" else None
    extra = {key: options[key] for key in ("scaling", "softcap") if options.get(key) is not None}
    attention_class = options.get("attention", GroupedQueryAttention)
    return attention_class(config, layer_idx, qkv_bias=options["qkv_bias"], o_bias=options["o_bias"],
                           qk_norm=options["qk_norm"], sliding_window=window, fused=fused, **extra)


def decoder_norm(config, options: dict, *, fused: bool = False) -> RMSNorm:
    """A residual-stream RMS norm of the family's ``norm_formula`` (``decoder_options``; default ``"llama"``, Gemma:
    ``"gemma"``, OLMo 2: ``"olmo2"``; see ``common/rms_norm.py``)."""
    return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula=options.get("norm_formula", "llama"),
                   fused=fused)


LLAMA_SPEC = StackSpec(block=LlamaDecoderLayer,
                       components=dict(attn=GroupedQueryAttention, mlp=GatedMLP, attn_norm=RMSNorm,
                                       mlp_norm=RMSNorm),
                       embed_tokens="embed_tokens", layers="layers", final_norm="norm", rotary="rotary_emb")


class LlamaPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = LlamaConfig
    config: LlamaConfig
    base_model_prefix = "model"
    stack_spec = LLAMA_SPEC
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _keys_to_ignore_on_load_unexpected = ["rotary_emb.inv_freq"]  # persisted by some old Llama conversions
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")
    _can_record_outputs = {"hidden_states": LlamaDecoderLayer, "attentions": GroupedQueryAttention}

    @classmethod
    def decoder_options(cls, config) -> dict:
        """The switches of this family's decoder (Llama: ``attention_bias`` on q/k/v/o, ``mlp_bias``). Optional keys
        other families set (``decoder_attention``, ``decoder_norm``): ``attention`` (the attention class),
        ``scaling``, ``softcap``, ``norm_formula``."""
        bias = bool(getattr(config, "attention_bias", False))
        return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)), qk_norm=False)

    @classmethod
    def attention_types(cls, config) -> list[str]:
        """Each layer's ``"full_attention"`` / ``"sliding_attention"`` (``common.causal_masks.layer_types``)."""
        return layer_types(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward, registered as ``mlp`` (the hook the MoE decoders override)."""
        return GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act,
                        bias=cls.decoder_options(config)["mlp_bias"])


class LlamaModel(TransformerStack, LlamaPreTrainedModel):
    """Embeddings, ``num_hidden_layers`` decoder layers, the final norm and the rotary embedding; the forward is the
    shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.LlamaModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)
    decoder_layer_class = LlamaDecoderLayer  # the MoE decoders (models/mixtral, qwen2_moe) swap in theirs

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        fused = self.parallel_context.config.fused_ops
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([self.build_layer(config, i, fused=fused)
                                     for i in range(config.num_hidden_layers)])
        self.norm = decoder_norm(config, self.decoder_options(config), fused=fused)
        self.rotary_emb = self.build_rotary(config)
        self.gradient_checkpointing = False
        self.post_init()
        if not submodule:
            self.finish_init()

    @classmethod
    def build_layer(cls, config, layer_idx: int, *, fused: bool = False) -> LlamaDecoderLayer:
        return cls.decoder_layer_class(config, layer_idx, options=cls.decoder_options(config),
                                       attention_type=cls.attention_types(config)[layer_idx],
                                       mlp=cls.build_mlp(config, layer_idx), fused=fused)

    @classmethod
    def build_rotary(cls, config) -> nn.Module:
        """The rotary module (``rotary_emb``): ``transformers``' Llama one here; Gemma 3 has one per layer type."""
        return RotaryEmbedding(config)


LlamaPreTrainedModel.base_model_class = LlamaModel


class LlamaForCausalLM(ForCausalLM, LlamaPreTrainedModel, GenerationMixin):
    hf_twin = transformers.LlamaForCausalLM
    # the stack's stages run the grid blocks (pipeline_stack.py): tp4(2d) x pp2 in tests/composition/test_eight_ranks
    pipeline_grid_modes = True


class LlamaForSequenceClassification(ForSequenceClassification, LlamaPreTrainedModel):
    hf_twin = transformers.LlamaForSequenceClassification


class LlamaForTokenClassification(ForTokenClassification, LlamaPreTrainedModel):
    hf_twin = transformers.LlamaForTokenClassification


class LlamaForQuestionAnswering(ForQuestionAnswering, LlamaPreTrainedModel):
    """Llama, Qwen2 and Qwen3 keep this head's base model under ``transformer`` (``transformers``'
    backward-compatible name); Mistral under ``model``."""

    hf_twin = transformers.LlamaForQuestionAnswering
    base_model_prefix = "transformer"
