"""DeBERTa-v2 (and v3), written single-device with the module tree and state-dict keys of ``transformers``'
DeBERTa-v2, on the shared stack.

The layers are BERT's post-norm tree (``attention.{self, output}``, ``intermediate``, ``output``; the output and
intermediate modules are BERT's, imported) with the disentangled self-attention
(``common/attention/disentangled_attention.py``) in ``attention.self``. What the stack carries for it: the encoder's
relative embeddings (``rel_embeddings``, after ``LayerNorm`` when ``norm_rel_ebd`` says ``layer_norm``) and the relative
positions (log buckets) are computed once per forward by ``DebertaV2Encoder.forward`` (the spec's ``rotary`` part: what
the stack hands every layer as its ``position_embeddings``); the mask is ``transformers``' ``[b, 1, s, s]`` of
``m_i * m_j``.

The embeddings (word, optional absolute positions, optional token types, ``embed_proj`` when ``embedding_size !=
hidden_size``, LayerNorm, padding zeroed, dropout) run replicated on the whole sequence, then the scatter to
``[b, s/tp, h]`` under sequence parallelism, as BERT's. Tensor parallelism splits the heads (q/k/v and the relative
projections column-parallel, ``output.dense`` row-parallel); ``rel_embeddings`` and its LayerNorm are replicated, their
gradient summed over TP by the projections' backward.

The convolution of deberta-v2-xlarge/xxlarge (``encoder.conv``, ``conv_kernel_size > 0``) runs replicated in the first
layer, on its input (the embeddings) and output. Refused with the reason: context parallelism (the relative terms
across chunks), the convolution under sequence or pipeline parallelism, and the non-legacy MLM head
(``legacy=False``).

Shapes: b batch, s sequence, h hidden, e embedding size, n heads (n/tp per rank), V vocabulary.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ...parallel_layers.plan import (
    PositionEmbedding,
    SequenceParallelNorm,
    TPDropout,
    VocabEmbedding,
)
from ..bert.modeling_bert import (
    BertIntermediate,
    BertLMPredictionHead,
    BertOnlyMLMHead,
    BertOutput,
    BertSelfOutput,
)
from ..bert.parallel_plan import prefixed
from ..common import enter_sequence_parallel
from ..common.attention.causal_masks import FULL
from ..common.attention.disentangled_attention import DisentangledSelfAttention, relative_span
from ..common.attention.encoder_masks import encoder_documents, same_document
from ..common.rules.parallel_rules import check_head_size
from ..common.stack.blocks import BlockTemplate
from ..common.stack.encoder_stack import PoolingArgument
from ..common.stack.outputs import capture_parallel_outputs
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import Embeddings, Layers, Rotary
from ..encoder_heads import (
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderHeadModel,
    ForMaskedLM,
    ForMultipleChoice,
)
from ..heads import StackFamilyModel, sequence_classification_loss
from ..modeling_utils import OsloPreTrainedModel
from .configuration_deberta_v2 import DebertaV2Config
from .pipeline_deberta_v2 import DEBERTA_SEQUENCE_CLASSIFICATION, DebertaV2Stages


class DebertaV2Embeddings(nn.Module):
    """``[b, s]`` ids -> ``[b, s, h]``: word (+ position when ``position_biased_input``) (+ token type when
    ``type_vocab_size > 0``), ``embed_proj`` (e -> h, when they differ), LayerNorm, padding rows zeroed, dropout.
    Replicated but for the vocab-parallel word table."""

    tp_plan = {"word_embeddings": VocabEmbedding(), "position_embeddings": PositionEmbedding(),
               "token_type_embeddings": PositionEmbedding(), "LayerNorm": SequenceParallelNorm(),
               "dropout": TPDropout()}

    def __init__(self, config):
        super().__init__()
        self.embedding_size = getattr(config, "embedding_size", config.hidden_size)
        self.word_embeddings = Embedding(config.vocab_size, self.embedding_size, padding_idx=config.pad_token_id)
        self.position_biased_input = getattr(config, "position_biased_input", True)
        self.position_embeddings = (Embedding(config.max_position_embeddings, self.embedding_size)
                                    if self.position_biased_input else None)
        self.token_type_embeddings = (Embedding(config.type_vocab_size, self.embedding_size)
                                      if config.type_vocab_size > 0 else None)
        self.embed_proj = (Linear(self.embedding_size, config.hidden_size, bias=False)
                           if self.embedding_size != config.hidden_size else None)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, mask=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # vocab-parallel: all-reduce over TP
        embeddings = inputs_embeds
        if self.position_embeddings is not None:
            embeddings = embeddings + self.position_embeddings(position_ids.long())
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(embeddings.shape[:2], dtype=torch.long, device=embeddings.device)
            embeddings = embeddings + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            embeddings = self.embed_proj(embeddings)
        embeddings = self.LayerNorm(embeddings)
        if mask is not None:
            embeddings = embeddings * mask.unsqueeze(-1).to(embeddings.dtype)
        return self.dropout(embeddings)


class DebertaV2Attention(nn.Module):
    """``self`` (disentangled, heads split) and ``output`` (row-parallel dense, dropout, post-LN residual)."""

    tp_plan = {**prefixed("self", DisentangledSelfAttention.tp_plan), **prefixed("output", BertSelfOutput.tp_plan)}
    parallel_rules = DisentangledSelfAttention.parallel_rules
    #: eager only (the c2p / p2c terms are added to the scores): every ``_supports_<kernel>`` flag is False
    kernels = frozenset()

    def __init__(self, config):
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = DebertaV2SelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        context, weights = self.self(hidden_states, attention_mask, position_embeddings)
        return self.output(context, hidden_states), weights


class DebertaV2SelfOutput(BertSelfOutput):
    pass


class DebertaV2Intermediate(BertIntermediate):
    pass


class DebertaV2Output(BertOutput):
    pass


class DebertaV2Layer(BlockTemplate):
    """Post-norm layer in BERT's tree: ``a = attention(x)``, then ``output(intermediate(a), a)``."""

    roles = ("attn", "intermediate", "output")
    names = dict(attn="attention", intermediate="intermediate", output="output")

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__(attn=DebertaV2Attention(config), intermediate=DebertaV2Intermediate(config),
                         output=DebertaV2Output(config))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        kwargs.pop("position_ids", None)
        attention_output, _ = self.part("attn")(hidden_states, attention_mask, position_embeddings, **kwargs)
        output = self.output(self.intermediate(attention_output), attention_output)
        conv = self.__dict__.get("encoder_conv")  # the first layer of deberta-v2-xlarge / xxlarge
        if conv is not None:  # on the embeddings (this layer's input) and this layer's output
            output = conv(hidden_states, output, attention_mask[:, 0].diagonal(dim1=-2, dim2=-1).long())
        return output


class ConvLayer(nn.Module):
    """``transformers``' DeBERTa-v2 ``ConvLayer`` (``encoder.conv``): a 1D convolution over the sequence of the
    embeddings, padding zeroed, activation, then ``LayerNorm(first layer's output + it)`` and padding zeroed.
    Replicated: it needs the whole sequence (refused under sequence parallelism) and every rank computes the same."""

    def __init__(self, config):
        super().__init__()
        kernel_size = getattr(config, "conv_kernel_size", 3)
        self.conv_act = getattr(config, "conv_act", "tanh")
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size, padding=(kernel_size - 1) // 2,
                              groups=getattr(config, "conv_groups", 1))
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, residual_states, input_mask):
        out = self.conv(hidden_states.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()
        out = out.masked_fill((1 - input_mask).bool().unsqueeze(-1), 0)
        out = ACT2FN[self.conv_act](self.dropout(out))
        output = self.LayerNorm(residual_states + out)
        return output * input_mask.unsqueeze(2).to(output.dtype)


class DebertaV2Encoder(nn.Module):
    """The layers (``layer.N``), the shared ``rel_embeddings`` and their ``LayerNorm``. ``forward(shape_like [b, s,
    h], position_ids)`` -> ``(rel_embeddings [P', h] | None, relative_pos [1, s, s] | None)``: what every layer's
    attention reads (the stack calls it once per forward, as it calls a rotary module)."""

    def __init__(self, config):
        super().__init__()
        # registered first, as transformers registers it; filled by the spec's ``Layers("encoder.layer")`` part
        self.layer = nn.ModuleList()
        self.relative_attention = getattr(config, "relative_attention", False)
        if self.relative_attention:
            self.position_buckets, self.max_relative_positions, span = relative_span(config)
            self.rel_embeddings = Embedding(span * 2, config.hidden_size)
        self.norm_rel_ebd = [x.strip() for x in getattr(config, "norm_rel_ebd", "none").lower().split("|")]
        if "layer_norm" in self.norm_rel_ebd:
            self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, elementwise_affine=True)
        self.conv = ConvLayer(config) if getattr(config, "conv_kernel_size", 0) > 0 else None

    def forward(self, shape_like: torch.Tensor, position_ids=None):
        if not self.relative_attention:
            return None, None
        rel_embeddings = self.rel_embeddings.weight
        if "layer_norm" in self.norm_rel_ebd:
            rel_embeddings = self.LayerNorm(rel_embeddings)
        relative_pos = build_relative_position(shape_like, shape_like, bucket_size=self.position_buckets,
                                               max_position=self.max_relative_positions)
        return rel_embeddings, relative_pos


DEBERTA_V2_SPEC = StackSpec(block=DebertaV2Layer,
                            components=dict(attn=DebertaV2Attention, intermediate=DebertaV2Intermediate,
                                            output=DebertaV2Output),
                            embed_tokens="embeddings.word_embeddings", final_norm=None,
                            extra_plan=prefixed("embeddings", DebertaV2Embeddings.tp_plan),
                            # the encoder is the "rotary" part: the stack calls it once per forward for what every
                            # layer's attention reads (relative embeddings and positions)
                            parts=(Embeddings("embeddings", DebertaV2Embeddings), Rotary("encoder", DebertaV2Encoder),
                                   Layers("encoder.layer")),
                            outputs={"attentions": DisentangledSelfAttention})


class DebertaV2PreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = DebertaV2Config
    config: DebertaV2Config
    base_model_prefix = "deberta"
    stack_spec = DEBERTA_V2_SPEC
    pipeline_stages = DebertaV2Stages  # relative embeddings on every stage (pipeline_deberta_v2.py)
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_unexpected = ["position_embeddings"]
    _decoder_bias_owner: ClassVar[str | None] = None

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # the components' rules: heads, intermediate_size
        check_head_size(config, "DebertaV2")
        if getattr(config, "conv_kernel_size", 0) > 0 and (parallel.sequence_parallel or
                                                           parallel.pipeline_parallel_size > 1):
            raise NotImplementedError("DeBERTa-v2's convolution layer (conv_kernel_size > 0, deberta-v2-xlarge / "
                                      "xxlarge) with sequence or pipeline parallelism is not implemented: it "
                                      "convolves the whole sequence of the embeddings inside the first layer")
        if parallel.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"DeBERTa-v2 under tensor_parallel_mode={parallel.tensor_parallel_mode!r} is "
                                      "not implemented: the relative-embedding table its attention projects is "
                                      "replicated, not a grid block; use '1d'")
        if parallel.context_parallel_size > 1:
            raise NotImplementedError("DeBERTa-v2 under context parallelism is not implemented: its relative "
                                      "(c2p / p2c) attention terms need every key's position across chunks, and the "
                                      "ring / all-to-all core merges plain softmax blocks only")

    def tie_parallel_weights(self) -> None:
        """The decoder weight tied to the word embeddings and, as ``transformers``, its bias to the head's ``bias``."""
        super().tie_parallel_weights()
        if self._decoder_bias_owner and getattr(self.config, "tie_word_embeddings", False):
            head = dict(self.named_modules()).get(self._decoder_bias_owner)  # None off a pipeline's last stage
            if head is not None:
                head.decoder.bias = head.bias


class DebertaV2Model(PoolingArgument, TransformerStack, DebertaV2PreTrainedModel):
    """Built from ``DEBERTA_V2_SPEC``'s parts: embeddings, the encoder (relative embeddings, their norm, the
    convolution) and its ``num_hidden_layers`` layers: ``last_hidden_state [b, s, h]`` (no pooler:
    ``add_pooling_layer`` is accepted, as the encoder heads pass it, and builds nothing)."""

    hf_twin = transformers.DebertaV2Model
    is_base_model = True
    causal = False
    output_class = BaseModelOutput

    def build_layer(self, config, layer_idx: int, options) -> DebertaV2Layer:
        """The spec's layer; the first one also runs the encoder's convolution (deberta-v2-xlarge / xxlarge), held
        as a plain attribute so its keys stay ``encoder.conv.*``."""
        layer = DebertaV2Layer(config, layer_idx)
        if layer_idx == 0 and self.encoder.conv is not None:
            object.__setattr__(layer, "encoder_conv", self.encoder.conv)
        return layer

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``transformers``' DeBERTa mask: bool ``[b, 1, s, s]``, query and key both non-padding, and for packed
        documents (``position_ids`` restarting) in one document: the relative (c2p / p2c) terms depend on ``q - k``
        only, which within a document is its distance run alone, so a packed row equals its documents one per row.
        The convolution layer (``conv_kernel_size > 0``) would mix documents: refused."""
        documents = encoder_documents(shape_like, attention_mask, position_ids)
        if documents is not None and self.encoder.conv is not None:
            raise NotImplementedError("packed documents through DeBERTa-v2's convolution layer (conv_kernel_size > "
                                      "0) are not implemented: the convolution runs over the whole row, across "
                                      "documents; run one sequence per row")
        if attention_mask is None:
            attention_mask = torch.ones(shape_like.shape[:2], device=shape_like.device)
        if attention_mask.dim() <= 2:
            keep = attention_mask[:, None, None, :].bool()
            keep = keep & keep.transpose(-1, -2)
            return {FULL: keep if documents is None else keep & same_document(documents)}
        return {FULL: (attention_mask.unsqueeze(1) if attention_mask.dim() == 3 else attention_mask).bool()}

    def _embed_phase(self, input_ids, inputs, inputs_embeds, token_type_ids) -> torch.Tensor:
        """The embeddings on the full ``[b, s, h]`` (replicated, outside the sequence-parallel region), padding rows
        zeroed (the mask's diagonal), then the scatter to ``[b, s/tp, h]`` under SP."""
        padding = inputs.masks[FULL][:, 0].diagonal(dim1=-2, dim2=-1)  # [b, s]: m_i * m_i
        hidden = self.parallel_context.sequence_parallel_region.run(
            False, self.embeddings, input_ids=input_ids, token_type_ids=token_type_ids,
            position_ids=inputs.position_ids, mask=padding, inputs_embeds=inputs_embeds)
        if inputs.sequence_parallel:
            hidden = enter_sequence_parallel(hidden, self.parallel_context)
        return hidden

    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_attentions=None, output_hidden_states=None, **kwargs) -> BaseModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        kwargs.pop("use_cache", None), kwargs.pop("past_key_values", None)
        shape_like = inputs_embeds if inputs_embeds is not None else input_ids[..., None]
        position_ids = self._packed_positions(shape_like, attention_mask, position_ids, kwargs)  # cu_seqlens/seq_idx
        inputs = self.stack_inputs(self._shape_only(shape_like), attention_mask, position_ids)
        hidden = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
                                **kwargs)
        return BaseModelOutput(last_hidden_state=hidden)


DebertaV2PreTrainedModel.base_model_class = DebertaV2Model


# ---------------------------------------------------------------------------------------------- heads
class LegacyDebertaV2PredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding_size = getattr(config, "embedding_size", config.hidden_size)
        self.dense = Linear(config.hidden_size, self.embedding_size)
        act = config.hidden_act
        self.transform_act_fn = ACT2FN[act] if isinstance(act, str) else act
        self.LayerNorm = LayerNorm(self.embedding_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class LegacyDebertaV2LMPredictionHead(BertLMPredictionHead):
    """BERT's prediction head over DeBERTa's transform (h -> e): the vocab-parallel ``decoder`` reads ``[b, s, e]``
    (tied to the word embeddings; its bias tied to this module's ``bias``): ``[b, s, h] -> [b, s, V_padded/tp]``."""

    transform_class = LegacyDebertaV2PredictionHeadTransform

    def __init__(self, config):
        super().__init__(config)
        self.embedding_size = self.transform.embedding_size


class LegacyDebertaV2OnlyMLMHead(BertOnlyMLMHead):
    prediction_class = LegacyDebertaV2LMPredictionHead


class ContextPooler(nn.Module):
    """``act(dense(dropout(h[:, 0])))``, replicated: ``[b, s, h] -> [b, pooler_hidden_size]``."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.pooler_hidden_size, config.pooler_hidden_size)
        self.dropout = Dropout(config.pooler_dropout)
        self.activation = ACT2FN[config.pooler_hidden_act]

    def forward(self, hidden_states):
        return self.activation(self.dense(self.dropout(hidden_states[:, 0])))


def _cls_dropout(config) -> float:
    drop = getattr(config, "cls_dropout", None)
    return config.hidden_dropout_prob if drop is None else drop


def deberta_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """``transformers``' DeBERTa rule when ``problem_type`` is unset (it sets none): regression for one label, else
    cross-entropy over the rows whose class index is ``>= 0`` (zero when there is none), else soft-label targets;
    with ``problem_type`` set, the common rule."""
    if config.problem_type is not None:
        return sequence_classification_loss(logits, labels, config)
    num_labels = logits.shape[-1]
    if num_labels == 1:
        return F.mse_loss(logits.view(-1).to(labels.dtype), labels.view(-1))
    if labels.dim() == 1 or labels.size(-1) == 1:
        labels = labels.view(-1)
        keep = labels >= 0
        if not bool(keep.any()):
            return torch.tensor(0).to(logits)
        return F.cross_entropy(logits[keep].float(), labels[keep].long())
    return -(torch.log_softmax(logits, -1) * labels).sum(-1).mean()


class DebertaV2ForMaskedLM(ForMaskedLM, DebertaV2PreTrainedModel):
    """The legacy MLM head ``cls.predictions`` (``transformers``' default, ``legacy=True``; see ``ForMaskedLM``)."""

    hf_twin = transformers.DebertaV2ForMaskedLM
    head_name, head_class = "cls", LegacyDebertaV2OnlyMLMHead
    _decoder_bias_owner = "cls.predictions"
    _keys_to_ignore_on_load_unexpected = [r"mask_predictions.*"]

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)
        if not getattr(config, "legacy", True):
            raise NotImplementedError("DebertaV2ForMaskedLM with legacy=False (the lm_predictions head reading the "
                                      "word embeddings) is not implemented; the legacy cls.predictions head is")


class _PooledHead(EncoderHeadModel):
    """``pooler`` (``ContextPooler`` on the first token), ``classifier``, ``dropout`` (``cls_dropout``), registered in
    ``transformers``' order; a pipeline's last stage holds them under the same names and runs ``head_logits``."""

    outputs_one = False
    uses_pooler = False  # the base model has no pooler: ``ContextPooler`` is the head's
    pipeline_head_modules = {"pooler": "pooler", "dropout": "dropout", "classifier": "classifier"}

    def build_head(self, config) -> None:
        self.num_labels = getattr(config, "num_labels", 2)
        self.pooler = ContextPooler(config)
        self.classifier = Linear(config.pooler_hidden_size, 1 if self.outputs_one else self.num_labels)
        self.dropout = Dropout(_cls_dropout(config))

    def head_logits(self, hidden, attention_mask=None, config=None):
        """``[b, s, h] -> [b, num_labels]`` (``[b*c, 1]`` for multiple choice), on the model or a last stage."""
        return self.classifier(self.dropout(self.pooler(hidden)))


class DebertaV2ForSequenceClassification(_PooledHead, EncoderForSequenceClassification, DebertaV2PreTrainedModel):
    """``EncoderForSequenceClassification``'s forward over ``_PooledHead``; the loss is DeBERTa's rule
    (``DEBERTA_SEQUENCE_CLASSIFICATION``)."""

    hf_twin = transformers.DebertaV2ForSequenceClassification
    head_rule = DEBERTA_SEQUENCE_CLASSIFICATION


class DebertaV2ForTokenClassification(EncoderForTokenClassification, DebertaV2PreTrainedModel):
    hf_twin = transformers.DebertaV2ForTokenClassification
    classifier_dropout = staticmethod(lambda config: config.hidden_dropout_prob)


class DebertaV2ForQuestionAnswering(EncoderForQuestionAnswering, DebertaV2PreTrainedModel):
    hf_twin = transformers.DebertaV2ForQuestionAnswering


class DebertaV2ForMultipleChoice(_PooledHead, ForMultipleChoice, DebertaV2PreTrainedModel):
    """``ForMultipleChoice``'s forward over ``_PooledHead``'s ``pooler``, ``dropout`` and one-score ``classifier``
    (the base model has no pooler)."""

    hf_twin = transformers.DebertaV2ForMultipleChoice
    outputs_one, uses_pooler = True, False
