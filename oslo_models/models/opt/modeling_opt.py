"""OPT, written single-device on the shared stack with the module tree and state-dict keys of ``transformers``' OPT:
the base model keeps everything under ``decoder`` (``model.decoder.layers.N.self_attn.q_proj``), which the spec
names with dotted paths.

What is particular to OPT, and where it lives:

- learned absolute positions with offset 2 (``common/embeddings/positions.py`` ``LearnedPositionalEmbedding``), at
  positions counted from the attention mask (``cumsum(mask) * mask - 1``, cut after the cached length), so left padding
  does not shift them: ``OPTModel.stack_inputs`` derives the position ids once per forward and the stack's embedding
  phase looks them up (``position_embeds``; a cached decode step without a mask continues at the cached length);
- ``do_layer_norm_before``: pre-norm (``True``) or post-norm (``False``) blocks under the same names; the final
  norm exists only with pre-norm and without ``_remove_final_layer_norm``;
- ``word_embed_proj_dim != hidden_size``: the token table (and the tied ``lm_head``) are ``word_embed_proj_dim``
  wide, with ``project_in`` after the lookup and ``project_out`` after the final norm (the spec's input and
  output projections: replicated, on the whole sequence);
- ``fc1``/``fc2`` sit on the layer itself (the feed-forward role named ``""``), ``self_attn_layer_norm`` and
  ``final_layer_norm`` per layer; the query is scaled before the kernel, as ``transformers`` does.

Shapes: b batch, s sequence, h hidden, e ``word_embed_proj_dim``, n heads (n/tp per rank), d head dim.
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.generation import GenerationMixin
from transformers.models.opt.modeling_opt import eager_attention_forward

from ...config import ParallelConfig
from ...parallel_layers.context_parallel import merge_sequence, split_sequence
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ...parallel_layers.plan import Colwise, Rowwise, StreamLinear, TPDropout
from ..common.attention.attention import AttentionModule, attend, split_heads
from ..common.attention.causal_masks import FULL
from ..common.embeddings.positions import LearnedPositionalEmbedding, LearnedPositions
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Heads, check_head_size
from ..common.stack.blocks import PostNormBlock, PreNormBlock
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import Built
from ..heads import ForCausalLM, ForQuestionAnswering, ForSequenceClassification, StackFamilyModel
from ..modeling_utils import OsloPreTrainedModel
from .configuration_opt import OPTConfig


class OPTAttention(AttentionModule):
    """``q_proj``/``k_proj``/``v_proj`` column-parallel (``n/tp`` heads per rank), ``out_proj`` row-parallel; the
    query is multiplied by ``head_dim ** -0.5`` before the kernel, which then runs unscaled (``transformers``'
    order of operations). Returns ``(output, weights)``."""

    tp_plan = {"q_proj": Colwise(), "k_proj": Colwise(), "v_proj": Colwise(), "out_proj": Rowwise(),
               "attn_dropout": TPDropout(always_split=True)}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config: OPTConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.embed_dim = config.hidden_size
        self.head_dim = self.embed_dim // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        bias = config.enable_bias
        self.k_proj = Linear(self.embed_dim, self.embed_dim, bias=bias)  # transformers' registration order
        self.v_proj = Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.q_proj = Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.out_proj = Linear(self.embed_dim, self.embed_dim, bias=bias)
        self.attn_dropout = Dropout(config.attention_dropout)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                **kwargs):
        query = split_heads(self.q_proj(hidden_states) * self.scaling, self.head_dim)  # [b, n/tp, s, d]
        key = split_heads(self.k_proj(hidden_states), self.head_dim)
        value = split_heads(self.v_proj(hidden_states), self.head_dim)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout, scaling=1.0,
                              eager_fallback=eager_attention_forward, **kwargs)
        return self.out_proj(out), weights  # [b, s(/tp), h]


class OPTFeedForward(DenseMLP):
    """The plan and rule of OPT's ``fc1`` (column-) / ``fc2`` (row-parallel) and the residual ``dropout``, which
    ``transformers`` keeps on the layer: the layer builds them (``OPTDecoderLayer.mlp_forward``)."""

    intermediate_attr = "ffn_dim"


class OPTDecoderLayer(PreNormBlock):
    """``self_attn``, ``self_attn_layer_norm``, ``fc1``, ``fc2``, ``final_layer_norm``; the pre-norm template with
    ``do_layer_norm_before``, the post-norm one without. Both residual branches end in ``dropout``."""

    names = dict(attn_norm="self_attn_layer_norm", attn="self_attn", mlp_norm="final_layer_norm", mlp="")
    optional_roles = (*PreNormBlock.optional_roles, "mlp")

    def __init__(self, config: OPTConfig, layer_idx: int):
        def norm():
            return LayerNorm(config.hidden_size, elementwise_affine=config.layer_norm_elementwise_affine)

        final_layer_norm = norm()
        super().__init__(attn=OPTAttention(config, layer_idx), attn_norm=norm(), mlp_norm=final_layer_norm,
                         order=("attn", "attn_norm"))
        # registered after the attention and its norm, as in transformers
        self.fc1 = Linear(config.hidden_size, config.ffn_dim, bias=config.enable_bias)
        self.fc2 = Linear(config.ffn_dim, config.hidden_size, bias=config.enable_bias)
        self.final_layer_norm = final_layer_norm
        self.dropout = Dropout(config.dropout)
        self.activation_fn = ACT2FN[config.activation_function]
        self.do_layer_norm_before = config.do_layer_norm_before

    def attend(self, x, attention_mask, position_embeddings, past_key_values, **kwargs) -> torch.Tensor:
        return self.dropout(super().attend(x, attention_mask, position_embeddings, past_key_values, **kwargs))

    def mlp_forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.dropout(self.fc2(self.activation_fn(self.fc1(x))))  # inner [b, s, ffn_dim/tp]

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        template = PreNormBlock if self.do_layer_norm_before else PostNormBlock
        return template.forward(self, hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)


OPT_SPEC = StackSpec(block=OPTDecoderLayer,
                     components=dict(attn_norm=LayerNorm, attn=OPTAttention, mlp_norm=LayerNorm, mlp=OPTFeedForward),
                     parts=(Built("decoder", lambda config, options: OPTDecoder(config)),),
                     embed_tokens="decoder.embed_tokens", position_embedding="decoder.embed_positions",
                     input_projection="decoder.project_in", layers="decoder.layers",
                     final_norm="decoder.final_layer_norm", output_projection="decoder.project_out",
                     # e <-> h projections outside the tp regions: replicated under 1D, grid linears under 2D/3D;
                     # the learned positions keep their offset lookup under the grid modes
                     extra_plan={"decoder.project_in": StreamLinear(), "decoder.project_out": StreamLinear(),
                                 "decoder.embed_positions": LearnedPositions()})


class OPTDecoder(nn.Module):
    """The container ``transformers`` names ``decoder``: ``embed_tokens [V, e]``, ``embed_positions``,
    ``project_out``/``project_in`` (``None`` when ``e == h``), ``final_layer_norm`` (``None`` under post-norm or
    ``_remove_final_layer_norm``) and ``layers``. ``OPTModel`` runs them through the shared stack."""

    def __init__(self, config: OPTConfig):
        super().__init__()
        hidden, width = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = Embedding(config.vocab_size, width, config.pad_token_id)
        self.embed_positions = LearnedPositionalEmbedding(config.max_position_embeddings, hidden)
        self.project_out = Linear(hidden, width, bias=False) if width != hidden else None
        self.project_in = Linear(width, hidden, bias=False) if width != hidden else None
        keep_final = config.do_layer_norm_before and not config._remove_final_layer_norm
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine) \
            if keep_final else None
        self.layers = nn.ModuleList([OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)])


def mask_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """OPT's positions ``[b, s]`` of a padding mask ``[b, s]``: counted over the tokens from 0, ``-1`` on padding."""
    return (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()


class OPTPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = OPTConfig
    config: OPTConfig
    base_model_prefix = "model"
    stack_spec = OPT_SPEC
    supports_gradient_checkpointing = True

    @classmethod
    def head_hidden_size(cls, config) -> int:
        return config.word_embed_proj_dim  # the heads read project_out's output

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # heads, ffn_dim
        check_head_size(config, "OPT")
        if config.layerdrop:
            raise NotImplementedError(f"OPT's layerdrop={config.layerdrop} (skipping whole layers at random in "
                                      "training) is not implemented: load the model with layerdrop=0")


class OPTModel(TransformerStack, OPTPreTrainedModel):
    """``decoder`` (``OPTDecoder``, the spec's one part) run by the shared stack, with positions from the attention
    mask. Output ``last_hidden_state``: ``[b, s, e]`` (after ``project_out``)."""

    hf_twin = transformers.OPTModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)

    def stack_inputs(self, shape_like, attention_mask=None, position_ids=None, past_key_values=None, **options):
        """Position ids from a 2D padding mask ``[b, past + s]`` when none are given (``cumsum(mask) * mask - 1``
        after the cached length: left padding does not shift them); without a mask the stack's ``past + arange(s)``,
        the same numbers. Under context parallelism the count runs over the whole sequence's padding, which the
        context-parallel mask has gathered, and each rank keeps its tokens' positions."""
        from_mask = position_ids is None and torch.is_tensor(attention_mask) and attention_mask.ndim == 2
        context = self.parallel_context
        if from_mask and context.cp_size == 1:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = mask_positions(attention_mask.to(shape_like.device))[:, past:]
        inputs = super().stack_inputs(shape_like, attention_mask, position_ids, past_key_values, **options)
        cp_mask = inputs.masks.get(FULL)
        if from_mask and context.cp_size > 1 and cp_mask.key_valid is not None:  # else the global positions
            mode = context.config.context_parallel_mode
            full = merge_sequence(list(cp_mask.key_valid.long()), mode)  # [b, s]: the whole padding mask
            inputs.position_ids = split_sequence(mask_positions(full), context.cp_rank, context.cp_size, mode)
        return inputs

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``transformers``' causal masks, built as OPT builds them: from the padding mask alone (position ids
        that restart are not read as packed documents)."""
        return super().layer_masks(shape_like, attention_mask, past_key_values, None, kinds)

    def position_embeds(self, position_ids) -> torch.Tensor:
        """``embed_positions`` rows ``position_ids + 2``; the stack adds them to ``project_in(embed_tokens(ids))``."""
        return self.decoder.embed_positions(None, position_ids=position_ids)


OPTPreTrainedModel.base_model_class = OPTModel


class OPTForCausalLM(ForCausalLM, OPTPreTrainedModel, GenerationMixin):
    """OPT with the LM head ``[V, e]`` tied to ``decoder.embed_tokens``."""

    hf_twin = transformers.OPTForCausalLM


class OPTForSequenceClassification(ForSequenceClassification, OPTPreTrainedModel):
    hf_twin = transformers.OPTForSequenceClassification


class OPTForQuestionAnswering(ForQuestionAnswering, OPTPreTrainedModel):
    hf_twin = transformers.OPTForQuestionAnswering
