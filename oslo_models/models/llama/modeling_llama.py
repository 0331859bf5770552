"""The Llama-shaped decoder, written once, single-device, with the module tree and state-dict keys of
``transformers``' Llama; Mistral, Qwen2 and Qwen3 are the same code with other switches (``decoder_options``) and
their own class names (``models/mistral``, ``models/qwen2``, ``models/qwen3``).

What differs between the four, and where it is decided:

- attention biases (Llama ``attention_bias``/``mlp_bias``, Qwen2 q/k/v biases, Qwen3 ``attention_bias``) and
  Qwen3's q/k RMS norms: ``decoder_options(config)``, the frozen ``DecoderOptions`` of a config (a class method each
  family overrides), built once per model and handed to every part and layer;
- sliding-window attention (Mistral ``sliding_window``, Qwen2/Qwen3 ``use_sliding_window``/``max_window_layers``,
  or ``layer_types``): ``attention_types(config)`` (``common.attention.causal_masks.layer_types``; Mistral overrides
  it);
- the feed-forward: ``build_mlp(config, layer_idx)`` (SwiGLU here; the hook mixture-of-experts decoders override);
- tied or untied embeddings: ``config.tie_word_embeddings``.

Gemma 1/2/3 and OLMo 2 (their own folders) use the same hooks further: ``decoder_options`` also picks the norm
formula, the score scale and the logit soft-cap; their spec names a sandwich-norm layer (``SandwichDecoderLayer``),
the attention component (read into the options: named once, in the spec) and the rotary module.

The layer is the pre-norm block template (``common/stack/blocks.py``) under Llama's names; the base model is built from
``LLAMA_SPEC``'s parts (``common/stack/stack_parts.py``) and its forward is the shared stack (``common/stack/stack.py``:
embeddings, layers, final norm, with the sequence-parallel region opened once per forward); the parallel plan, the
divisibility checks and the class flags are derived from the spec; the heads are the generic ones
(``models/heads.py``). Parallelism enters only through the layers the plan swaps in.

Shapes: b batch, s sequence, h hidden, n query heads (n/tp per rank), n_kv key/value heads, d head dim, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import transformers
from torch import nn
from transformers.generation import GenerationMixin

from ..common import GatedMLP, GroupedQueryAttention, RMSNorm, RotaryEmbedding, layer_types
from ..common.rules.capabilities import Capabilities
from ..common.stack.blocks import PreNormBlock, SandwichNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import FinalNorm, Layers, Rotary, TokenEmbedding
from ..heads import (
    ForCausalLM,
    ForQuestionAnswering,
    ForSequenceClassification,
    ForTokenClassification,
    StackFamilyModel,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_llama import LlamaConfig


@dataclass(frozen=True)
class DecoderOptions:
    """The switches of a Llama-shaped decoder for one config (``decoder_options(config)``), read by the layers and
    the final norm: ``attention`` (the spec's attention component, read from the spec, not named again), biases on
    q/k/v, o and the MLP, q/k norms (``False``, ``True`` or a norm formula), the residual norms' ``norm_formula``
    (``common/norms/rms_norm.py``), and, when set, the score ``scaling`` and ``softcap`` (Gemma 2/3)."""

    attention: type = GroupedQueryAttention
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool | str = False
    norm_formula: str = "llama"
    scaling: float | None = None
    softcap: float | None = None


class LlamaDecoderLayer(PreNormBlock):
    """Pre-norm block: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``.
    ``attention_type`` (full or sliding) picks this layer's mask from the stack's ``{type: mask}``; ``mlp`` is the
    family's feed-forward (``build_mlp``: the SwiGLU ``GatedMLP`` here, a mixture-of-experts block in the MoE
    decoders)."""

    names = dict(attn_norm="input_layernorm", attn="self_attn", mlp_norm="post_attention_layernorm", mlp="mlp")

    def __init__(self, config, layer_idx: int, *, options: DecoderOptions, attention_type: str, mlp: nn.Module):
        attention = decoder_attention(config, layer_idx, options, attention_type)
        # registered in transformers' order (self_attn, mlp, input_layernorm, post_attention_layernorm)
        super().__init__(attn=attention, mlp=mlp, attn_norm=decoder_norm(config, options),
                         mlp_norm=decoder_norm(config, options),
                         order=("attn", "mlp", "attn_norm", "mlp_norm"))
        self.attention_type = attention_type


class SandwichDecoderLayer(SandwichNormBlock):
    """The Llama-shaped layer on the sandwich-norm template (``common/stack/blocks.py``): ``x + post_attn_norm(attn(
    attn_norm(x)))``, then the same around the MLP. A family's subclass gives ``transformers``' ``names``; the norms
    it names are built (``decoder_norm``), those it leaves out are skipped: Gemma 2/3 name all four, OLMo 2 only the
    two post norms. Registered as ``transformers`` registers them: ``self_attn``, ``mlp``, then the norms in block
    order."""

    def __init__(self, config, layer_idx: int, *, options: DecoderOptions, attention_type: str, mlp: nn.Module):
        norms = {role: decoder_norm(config, options)
                 for role in self.roles if role.endswith("norm") and role in self.names}
        super().__init__(attn=decoder_attention(config, layer_idx, options, attention_type), mlp=mlp,
                         **norms, order=("attn", "mlp", *norms))
        self.attention_type = attention_type


def decoder_attention(config, layer_idx: int, options: DecoderOptions, attention_type: str):
    """Layer ``layer_idx``'s attention from the family's ``DecoderOptions``: its ``attention`` class, the biases and
    q/k norms, and, when set, ``scaling`` / ``softcap`` (Gemma 2/3); the config's ``sliding_window`` on
    ``"sliding_attention"`` layers."""
    window = config.sliding_window if attention_type == "sliding_attention" else None
    extra = {key: value for key, value in (("scaling", options.scaling), ("softcap", options.softcap))
             if value is not None}
    return options.attention(config, layer_idx, qkv_bias=options.qkv_bias, o_bias=options.o_bias,
                             qk_norm=options.qk_norm, sliding_window=window, **extra)


def decoder_norm(config, options: DecoderOptions) -> RMSNorm:
    """A residual-stream RMS norm of the family's ``norm_formula`` (``DecoderOptions``; Llama ``"llama"``, Gemma:
    ``"gemma"``, OLMo 2: ``"olmo2"``; see ``common/norms/rms_norm.py``); also the final norm's builder."""
    return RMSNorm(config.hidden_size, eps=config.rms_norm_eps, formula=options.norm_formula)


#: the Llama-shaped base model's parts, in transformers' registration order (Gemma 3 and Phi-3 swap the rotary)
DECODER_PARTS = (TokenEmbedding("embed_tokens"), Layers("layers"), FinalNorm("norm", decoder_norm),
                 Rotary("rotary_emb", RotaryEmbedding))
LLAMA_SPEC = StackSpec(block=LlamaDecoderLayer,
                       components=dict(attn=GroupedQueryAttention, mlp=GatedMLP, attn_norm=RMSNorm,
                                       mlp_norm=RMSNorm),
                       parts=DECODER_PARTS)


class LlamaPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = LlamaConfig
    config: LlamaConfig
    base_model_prefix = "model"
    stack_spec = LLAMA_SPEC
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values"]
    _keys_to_ignore_on_load_unexpected = ["rotary_emb.inv_freq"]  # persisted by some old Llama conversions
    # 3D tensor parallelism: position ids feed only the rotary attention, which runs in the inner layout
    grid_inner_inputs = ("attention_mask", "position_ids")
    #: the frozen class of ``decoder_options`` (the MoE decoders' adds their sparse blocks' switches)
    options_class = DecoderOptions

    @classmethod
    def switches(cls, **values) -> DecoderOptions:
        """``options_class`` with ``values`` and the spec's attention component."""
        return cls.options_class(attention=cls.stack_spec.components["attn"], **values)

    @classmethod
    def decoder_options(cls, config) -> DecoderOptions:
        """The switches of this family's decoder for ``config`` (Llama: ``attention_bias`` on q/k/v/o,
        ``mlp_bias``); a family overrides it with its own (``switches(...)``)."""
        return cls.biased_switches(config, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    @classmethod
    def biased_switches(cls, config, **values) -> DecoderOptions:
        """``switches(**values)`` with ``config.attention_bias`` on q/k/v and o (Llama, Qwen3, Gemma, OLMo 2,
        GPT-OSS)."""
        bias = bool(getattr(config, "attention_bias", False))
        return cls.switches(qkv_bias=bias, o_bias=bias, **values)

    @classmethod
    def stack_options(cls, config) -> DecoderOptions:
        return cls.decoder_options(config)

    @classmethod
    def attention_types(cls, config) -> list[str]:
        """Each layer's ``"full_attention"`` / ``"sliding_attention"``
        (``common.attention.causal_masks.layer_types``)."""
        return layer_types(config)

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options: DecoderOptions | None = None) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward, registered as ``mlp`` (the hook the MoE decoders override);
        ``options``: the config's ``decoder_options`` (built when not given)."""
        options = cls.decoder_options(config) if options is None else options
        return GatedMLP(config.hidden_size, config.intermediate_size, act=config.hidden_act, bias=options.mlp_bias)


class LlamaModel(TransformerStack, LlamaPreTrainedModel):
    """Built from the spec's parts: embeddings, ``num_hidden_layers`` decoder layers, the final norm and the rotary
    embedding; the forward is the shared stack's. Output ``last_hidden_state``: ``[b, s, h]``."""

    hf_twin = transformers.LlamaModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)

    def build_layer(self, config, layer_idx: int, options: DecoderOptions) -> nn.Module:
        """The spec's block with the layer's attention type and feed-forward (``build_mlp``)."""
        return self.stack_spec.block(config, layer_idx, options=options,
                                     attention_type=self.attention_types(config)[layer_idx],
                                     mlp=self.build_mlp(config, layer_idx, options))


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
