"""ModernBERT, written single-device with the module tree and state-dict keys of ``transformers``' ModernBERT.

The base model is the shared stack (``common/stack/stack.py``) with a pre-norm block: the token embeddings
(vocab-parallel) are scattered to ``[b, s/tp, h]`` under sequence parallelism before the embedding norm and dropout (the
spec's ``embedding_norm`` / ``embedding_dropout``), the layers are ``x + attn(attn_norm(x))``, ``x + mlp(mlp_norm(x))``
(the first layer's ``attn_norm`` is ``nn.Identity``, as in ``transformers``), and the final norm runs before the gather
back to ``[b, s, h]``. What is ModernBERT's own:

- attention: one ``Wqkv`` packed ``[3, n, d]`` (all queries, then keys, then values: ``Colwise(num_packed=3)``, so
  rank ``r`` keeps heads ``r*n/tp .. (r+1)*n/tp`` of each), rotary on q/k, bidirectional, row-parallel ``Wo`` and
  the residual dropout ``out_drop``;
- alternating global and local layers (``config.layer_types``): local layers see keys within
  ``config.sliding_window`` (= ``local_attention // 2``) positions on either side (``transformers``' bidirectional
  sliding-window mask; under context parallelism the layer's ``sliding_window + 1`` bounds ``|q - k|`` in the
  context-parallel core); each type has its own rotary base (``rope_parameters[layer_type]``);
- GeGLU feed-forward with one fused ``Wi`` ``[2i, h]`` holding ``input | gate``: ``Colwise(num_packed=2)`` splits each
  half, so rank ``r``'s local output ``[b, s, 2i/tp]`` is ``input_r | gate_r`` and chunks locally;
- no biases (``attention_bias``, ``mlp_bias``, ``norm_bias`` default ``False``);
- the heads: ``head`` (dense, activation, norm; replicated) then the vocab-parallel ``decoder`` (tied to the token
  embeddings, its own bias) for masked LM, or a pooled (``classifier_pooling``: ``cls`` / ``mean``) replicated
  ``classifier`` for the classification heads.

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    MaskedLMOutput,
    SequenceClassifierOutput,
)
from transformers.models.modernbert import modeling_modernbert as hf_modernbert
from transformers.utils.generic import can_return_tuple

from ...config import ParallelConfig
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ...parallel_layers.plan import Colwise, Rowwise, SequenceParallelNorm, TPDropout
from ..common import PerLayerTypeRotary
from ..common.attention.attention import AttentionModule, attend
from ..common.attention.causal_masks import FULL, SLIDING
from ..common.attention.encoder_masks import document_bidirectional_masks, encoder_documents
from ..common.embeddings.rotary import apply_rotary
from ..common.loss.head_rules import (
    MASKED_LM,
    MULTIPLE_CHOICE,
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
)
from ..common.loss.lm_loss import head_loss_and_logits
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Features, Heads
from ..common.stack.blocks import PreNormBlock
from ..common.stack.context_parallel import context_parallel_loss, context_parallel_loss_items
from ..common.stack.encoder_stack import PoolingArgument
from ..common.stack.fused_kernels import FusedKernels
from ..common.stack.outputs import capture_parallel_outputs, passed_on
from ..common.stack.stack import StackSpec, TransformerStack
from ..common.stack.stack_parts import Embeddings, FinalNorm, Layers, Rotary
from ..encoder_heads import EncoderHeadModel
from ..heads import (
    StackFamilyModel,
    flatten_choices,
    multiple_choice_output,
    question_answering_output,
    sequence_classification_loss,
    token_classification_output,
)
from ..modeling_utils import OsloPreTrainedModel
from .configuration_modernbert import ModernBertConfig
from .pipeline_modernbert import ModernBertStages


def _norm(config, options=None) -> LayerNorm:
    """ModernBERT's LayerNorm (``norm_bias``): the MLP norm, the final norm's builder, the heads' norm."""
    return LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


@dataclass(frozen=True)
class NormOrIdentityStyle(SequenceParallelNorm):
    """The sequence-parallel norm style, leaving the first layer's parameter-free ``nn.Identity`` ``attn_norm``
    as it is (the pattern ``layers.*.attn_norm`` matches it too)."""

    def build(self, module, context):
        return module if isinstance(module, nn.Identity) else super().build(module, context)


class ModernBertNorm(LayerNorm):
    """A layer's ``attn_norm`` component (the first layer's is ``nn.Identity``)."""

    tp_plan = {"": NormOrIdentityStyle()}


class ModernBertEmbeddings(nn.Module):
    """``tok_embeddings`` (vocab-parallel), ``norm``, ``drop``. The stack runs the parts (the spec names them), so
    under sequence parallelism the norm and dropout act on this rank's tokens; ``forward`` is the whole module as
    ``transformers`` runs it."""

    def __init__(self, config):
        super().__init__()
        self.tok_embeddings = Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = _norm(config)
        self.drop = Dropout(config.embedding_dropout)

    def forward(self, input_ids=None, inputs_embeds=None) -> torch.Tensor:
        return self.drop(self.norm(self.tok_embeddings(input_ids) if inputs_embeds is None else inputs_embeds))


class ModernBertAttention(FusedKernels, AttentionModule):
    """Bidirectional attention on this rank's heads with rotary positions: input ``[b, s(/tp), h]``, output
    ``([b, s(/tp), h], weights)``. ``Wqkv`` column-parallel in three packed blocks (gathers the sequence under SP),
    ``Wo`` row-parallel (all-reduce / reduce-scatter: the only forward collective), ``out_drop`` on the residual
    stream. ``attn_dropout`` is the attention-probability dropout (``config.attention_dropout``, a float in
    ``transformers``), drawn from the tensor-parallel stream."""

    tp_plan = {"Wqkv": Colwise(num_packed=3), "Wo": Rowwise(), "attn_dropout": TPDropout(always_split=True),
               "out_drop": TPDropout()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(f"The hidden size ({config.hidden_size}) is not a multiple of the number of attention "
                             f"heads ({config.num_attention_heads})")
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = False
        # transformers' rule: the kernel's window is the half-window + 1 (flash attention's inclusive bounds)
        local = config.layer_types[layer_idx] == SLIDING
        self.sliding_window = config.sliding_window + 1 if local else None
        self.Wqkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.out_drop = Dropout(config.attention_dropout)
        self.attn_dropout = Dropout(config.attention_dropout)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        qkv = self.Wqkv(hidden_states)  # [b, s, 3*(n/tp)*d]: q | k | v, each head-major
        qkv = qkv.view(*qkv.shape[:2], 3, -1, self.head_dim).permute(2, 0, 3, 1, 4)  # [3, b, n/tp, s, d]
        query, key, value = qkv.unbind(0)
        cos, sin = position_embeddings
        query, key = apply_rotary(query, key, cos, sin, fused=self.fused)
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attn_dropout,
                              scaling=self.scaling, eager_fallback=hf_modernbert.eager_attention_forward,
                              sliding_window=self.sliding_window, **kwargs)  # [b, s, (n/tp)*d]
        return self.out_drop(self.Wo(out)), weights


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(drop(act(input) * gate))`` with ``input | gate = Wi(x)``. ``Wi`` column-parallel in two packed
    blocks (each rank's ``input_r | gate_r``), ``Wo`` row-parallel. ``[b, s(/tp), h] -> [b, s(/tp), h]``."""

    tp_plan = {"Wi": Colwise(num_packed=2), "drop": TPDropout(always_split=True), "Wo": Rowwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("intermediate_size", config.intermediate_size)]

    def __init__(self, config):
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.act = ACT2FN[config.hidden_activation]
        self.drop = Dropout(config.mlp_dropout)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        inputs, gate = self.Wi(hidden_states).chunk(2, dim=-1)  # each [b, s, i/tp]
        return self.Wo(self.drop(self.act(inputs) * gate))


class ModernBertEncoderLayer(PreNormBlock):
    names = dict(attn_norm="attn_norm", attn="attn", mlp_norm="mlp_norm", mlp="mlp")

    def __init__(self, config, layer_idx: int):
        super().__init__(attn_norm=nn.Identity() if layer_idx == 0 else ModernBertNorm(
            config.hidden_size, eps=config.norm_eps, bias=config.norm_bias),
            attn=ModernBertAttention(config, layer_idx), mlp_norm=_norm(config), mlp=ModernBertMLP(config))
        self.attention_type = config.layer_types[layer_idx]


class ModernBertRotaryEmbedding(PerLayerTypeRotary, hf_modernbert.ModernBertRotaryEmbedding):
    """``forward(x, position_ids) -> {"full_attention": (cos, sin), "sliding_attention": (cos, sin)}``: the global
    and the local base."""

    hf_rotary = hf_modernbert.ModernBertRotaryEmbedding


MODERNBERT_SPEC = StackSpec(block=ModernBertEncoderLayer,
                            components=dict(attn_norm=ModernBertNorm, attn=ModernBertAttention, mlp_norm=LayerNorm,
                                            mlp=ModernBertMLP),
                            embed_tokens="embeddings.tok_embeddings", embedding_norm="embeddings.norm",
                            embedding_dropout="embeddings.drop", norm=LayerNorm,
                            parts=(Embeddings("embeddings", ModernBertEmbeddings), Layers("layers"),
                                   FinalNorm("final_norm", _norm),
                                   Rotary("rotary_emb", ModernBertRotaryEmbedding)))


class ModernBertPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = ModernBertConfig
    config: ModernBertConfig
    base_model_prefix = "model"
    stack_spec = MODERNBERT_SPEC
    pipeline_stages = ModernBertStages  # rotary on every stage, final norm on the last (pipeline_modernbert.py)
    supports_gradient_checkpointing = True

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # the components' rules: heads, intermediate_size
        if parallel.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"ModernBERT under tensor_parallel_mode={parallel.tensor_parallel_mode!r} is "
                                      "not implemented: its prediction head and classifiers have no grid plan; use "
                                      "'1d'")


class ModernBertModel(PoolingArgument, TransformerStack, ModernBertPreTrainedModel):
    """Built from ``MODERNBERT_SPEC``'s parts: embeddings, ``num_hidden_layers`` pre-norm layers, ``final_norm``,
    the rotary module: ``last_hidden_state [b, s, h]`` (no pooler: ``add_pooling_layer`` is accepted, as the
    encoder heads pass it, and builds nothing)."""

    hf_twin = transformers.ModernBertModel
    is_base_model = True
    causal = False
    output_class = BaseModelOutput
    capabilities = Capabilities(context_parallel=True)

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``transformers``' bidirectional masks: padding only (global layers), padding and ``|q - k| <=
        sliding_window`` (local layers); a dict of them passes through."""
        if isinstance(attention_mask, dict):
            return attention_mask
        documents = encoder_documents(shape_like, attention_mask, position_ids)
        if documents is not None:  # packed: within each document (rotary and windows read q - k only)
            return document_bidirectional_masks(self.config, shape_like, documents, kinds)
        options = dict(config=self.config, inputs_embeds=shape_like, attention_mask=attention_mask)
        build = {FULL: create_bidirectional_mask, SLIDING: create_bidirectional_sliding_window_mask}
        return {kind: build[kind](**options) for kind in kinds}

    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                token_type_ids=None, output_attentions=None, output_hidden_states=None, **kwargs) -> BaseModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        kwargs.pop("use_cache", None), kwargs.pop("past_key_values", None)  # an encoder keeps no cache
        shape_like = inputs_embeds if inputs_embeds is not None else input_ids[..., None]
        position_ids = self._packed_positions(shape_like, attention_mask, position_ids, kwargs)  # cu_seqlens/seq_idx
        inputs = self.stack_inputs(self._shape_only(shape_like), attention_mask, position_ids)
        hidden = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds, **kwargs)
        return BaseModelOutput(last_hidden_state=hidden)


ModernBertPreTrainedModel.base_model_class = ModernBertModel


# ---------------------------------------------------------------------------------------------- heads
class ModernBertPredictionHead(nn.Module):
    """``norm(act(dense(x)))``, replicated: ``[..., h] -> [..., h]``."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = ACT2FN[config.classifier_activation]
        self.norm = _norm(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden_states)))


def pool(hidden: torch.Tensor, attention_mask, how: str, *, first_token=None) -> torch.Tensor:
    """``[b, s, h] -> [b, h]``: the token at ``first_token`` (``[b]`` indices; default 0) for ``"cls"``, the
    mean over the non-padding tokens for ``"mean"`` (``transformers``' ``classifier_pooling``)."""
    if how == "cls":
        if first_token is None:
            return hidden[:, 0]
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), first_token]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], device=hidden.device, dtype=torch.bool)
    return (hidden * attention_mask.unsqueeze(-1)).sum(dim=1) / attention_mask.sum(dim=1, keepdim=True)


def _classify(holder, hidden: torch.Tensor) -> torch.Tensor:
    """``classifier(drop(head(x)))`` on the modules of ``holder`` (the model, or a pipeline's last stage)."""
    return holder.classifier(holder.drop(holder.head(hidden)))


class _ModernBertHead(EncoderHeadModel):
    """A head reading ``head`` -> ``drop`` -> ``classifier`` (``classifier_outputs`` wide) from the base model; its
    ``head_logits`` runs on the model or on a pipeline's last stage holding the same modules (``head_rules.py``)."""

    classifier_outputs = "num_labels"
    pipeline_head_modules = {"head": "head", "drop": "drop", "classifier": "classifier"}

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.head = ModernBertPredictionHead(config)
        self.drop = Dropout(config.classifier_dropout)
        width = config.num_labels if self.classifier_outputs == "num_labels" else 1
        self.classifier = Linear(config.hidden_size, width)

    def head_logits(self, hidden, attention_mask=None, config=None):
        """Every token's scores ``[b, s, num_labels]`` (token classification, QA); pooling heads override."""
        return _classify(self, hidden)


class ModernBertForMaskedLM(EncoderHeadModel, ModernBertPreTrainedModel):
    """``decoder(head(h))``: the replicated ``head`` then the vocab-parallel ``decoder`` (weight tied to the token
    embeddings, bias split like its outputs); the loss on the vocab-split logits, ``logits`` gathered to ``[b, s, V]``
    unless ``gather_logits=False``. ``config.sparse_prediction``: with ``labels``, only the labelled tokens go
    through the head (``logits [n_labelled, V]``), as ``transformers``. Under context parallelism the loss is the mean
    over the whole sequence."""

    hf_twin = transformers.ModernBertForMaskedLM
    head_styles = {"decoder": Colwise(vocab=True)}
    capabilities = Capabilities(context_parallel=True)
    accepts_packed = True
    head_rule = MASKED_LM
    _tied_weights_keys = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}

    @classmethod
    def mlm_head_module_names(cls) -> tuple[str, ...]:
        return ("head",)

    @classmethod
    def mlm_decoder_path(cls) -> str:
        return "decoder"

    @classmethod
    def mlm_transform(cls, holder, hidden):
        return holder.head(hidden)

    def build_head(self, config) -> None:
        self.head = ModernBertPredictionHead(config)
        self.decoder = Linear(config.hidden_size, config.vocab_size, bias=config.decoder_bias)

    def get_output_embeddings(self):
        return getattr(self, "decoder", None)

    def set_output_embeddings(self, new_embeddings) -> None:
        self.decoder = new_embeddings

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                gather_logits: bool = True, num_items_in_batch=None, skip_logits: bool = False,
                token_type_ids=None, **kwargs) -> MaskedLMOutput:
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        hidden = outputs.last_hidden_state
        if self.config.sparse_prediction and labels is not None:  # one row of the labelled tokens
            keep = labels.reshape(-1) != self.config.sparse_pred_ignore_index
            hidden = hidden.reshape(-1, hidden.shape[-1])[keep][None]
            labels = labels.reshape(-1)[keep][None]
        if labels is not None:
            num_items_in_batch = context_parallel_loss_items(self, labels, num_items_in_batch, causal=False)
        loss, logits = head_loss_and_logits(self.decoder, self.head(hidden), labels, causal=False,
                                            skip_logits=skip_logits, fused=self.parallel_context.config.fused_ops,
                                            gather_logits=gather_logits, num_items_in_batch=num_items_in_batch)
        if logits is not None and self.config.sparse_prediction and labels is not None:
            logits = logits[0]
        return MaskedLMOutput(loss=context_parallel_loss(self, loss), logits=logits, **passed_on(outputs))


class ModernBertForSequenceClassification(_ModernBertHead, ModernBertPreTrainedModel):
    """``logits [b, num_labels]`` from the ``cls`` token or the mean over non-padding tokens."""

    hf_twin = transformers.ModernBertForSequenceClassification
    head_rule = SEQUENCE_CLASSIFICATION

    def head_logits(self, hidden, attention_mask=None, config=None):
        """``[b, s, h] -> [b, num_labels]``: the ``classifier_pooling`` pooled state (``cls``/``mean``)."""
        return _classify(self, pool(hidden, attention_mask, (config or self.config).classifier_pooling))

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                token_type_ids=None, **kwargs) -> SequenceClassifierOutput:
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        logits = self.head_logits(outputs.last_hidden_state, attention_mask, self.config)
        loss = sequence_classification_loss(logits, labels, self.config) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits, **passed_on(outputs))


class ModernBertForTokenClassification(_ModernBertHead, ModernBertPreTrainedModel):
    hf_twin = transformers.ModernBertForTokenClassification
    accepts_packed = True
    head_rule = TOKEN_CLASSIFICATION

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                token_type_ids=None, num_items_in_batch=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        logits = self.head_logits(outputs.last_hidden_state)
        return token_classification_output(logits, labels, outputs, num_items_in_batch)


class ModernBertForQuestionAnswering(_ModernBertHead, ModernBertPreTrainedModel):
    hf_twin = transformers.ModernBertForQuestionAnswering
    head_rule = QUESTION_ANSWERING

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, start_positions=None,
                end_positions=None, inputs_embeds=None, token_type_ids=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        return question_answering_output(self.head_logits(outputs.last_hidden_state), start_positions, end_positions,
                                         outputs)


class ModernBertForMultipleChoice(_ModernBertHead, ModernBertPreTrainedModel):
    """``[b, c, s]`` flattened to ``[b*c, s]``; one score per choice from the pooled state (``cls``: the first
    non-padding token, as ``transformers``): ``logits [b, c]``."""

    hf_twin = transformers.ModernBertForMultipleChoice
    head_rule = MULTIPLE_CHOICE
    classifier_outputs = "one"

    def head_logits(self, hidden, attention_mask=None, config=None):
        """``[b*c, s, h] -> [b*c, 1]``; ``cls`` pools each row's first non-padding token."""
        first = attention_mask.argmax(dim=-1) if attention_mask is not None else None
        return _classify(self, pool(hidden, attention_mask, (config or self.config).classifier_pooling,
                                    first_token=first))

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                token_type_ids=None, **kwargs):
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        input_ids, attention_mask, position_ids, inputs_embeds = flatten_choices(
            input_ids, attention_mask, position_ids, inputs_embeds)
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        logits = self.head_logits(outputs.last_hidden_state, attention_mask, self.config)
        return multiple_choice_output(logits, labels, num_choices, outputs)
