"""ALBERT on the shared stack, with ``transformers``' module tree and keys.

What differs from BERT:

- **factorized embeddings**: the word / position / token-type tables are ``embedding_size`` (e) wide; the embedding
  phase runs them and ``encoder.embedding_hidden_mapping_in`` (a replicated ``[e, h]`` linear) on the full
  ``[b, s, e]``, before the sequence-parallel scatter, so the mapping's gradient is the same on every TP rank;
- **parameters shared across depth**: ``encoder.albert_layer_groups`` holds ``num_hidden_groups`` groups of
  ``inner_group_num`` layers; layer ``i`` of the ``num_hidden_layers`` runs group ``int(i / (L / G))``. The stack
  runs that list (``_layers``: the same group module several times), so each shared parameter is one tensor: one
  parameter object, its gradient summed over its uses by autograd, saved once under ``transformers``' key, split
  once by the plan (``albert_layer_groups.*.albert_layers.*``). Pipeline stages cut the depth: a group run on
  several stages is held by each of their ranks, its copies' gradients summed across them (``pipeline_albert.py``);
- each layer (``AlbertLayer``): ``attention`` (q/k/v column-parallel on this rank's heads, ``dense`` row-parallel:
  all-reduce, or reduce-scatter under sequence parallelism, dropout, ``LayerNorm(x + .)``), then ``ffn`` (column-)
  and ``ffn_output`` (row-parallel) and ``full_layer_layer_norm(a + .)``;
- the pooler is a ``pooler`` linear and ``pooler_activation`` (tanh) on the model, on the first token;
- heads: the MLM head ``predictions`` (dense ``[h, e]``, activation, LayerNorm: replicated; the vocab-parallel
  ``decoder`` tied to the word embeddings, its bias to ``predictions.bias``), the sentence-order head
  ``sop_classifier`` on the pooled state, and the replicated classification heads (``classifier_dropout_prob``).

Shapes: b batch, s sequence (``/tp`` inside the layers under sequence parallelism), h hidden, e embedding width,
n heads, d head dim, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.albert.modeling_albert import AlbertForPreTrainingOutput, eager_attention_forward
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.head_parallel import VocabBias
from ...parallel_layers.layers import Dropout, LayerNorm, Linear
from ...parallel_layers.plan import Colwise, Rowwise, SequenceParallelNorm, StreamLinear, TPDropout
from ..bert.modeling_bert import BertEmbeddings, BertModel, BertPreTrainedModel
from ..bert.parallel_plan import prefixed
from ..common import attend, full_logits, split_heads, token_loss
from ..common.attention.attention import AttentionModule
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Features, Heads
from ..common.stack.outputs import passed_on
from ..common.stack.stack import StackSpec
from ..common.stack.stack_parts import Built, Container, Embeddings, Layers, Pooler, Pooling
from ..encoder_heads import (
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    ForMaskedLM,
    ForMultipleChoice,
)
from .configuration_albert import AlbertConfig
from .pipeline_albert import AlbertPooling, AlbertStages, check_sharded_pipeline


def _classifier_dropout(config) -> float:
    """ALBERT's rule: ``classifier_dropout_prob``, else ``hidden_dropout_prob``."""
    return config.classifier_dropout_prob if config.classifier_dropout_prob is not None else config.hidden_dropout_prob


class AlbertEmbeddings(BertEmbeddings):
    """BERT's embeddings ``embedding_size`` wide: ``[b, s]`` ids -> ``[b, s, e]``."""

    width_attribute = "embedding_size"


class AlbertAttention(AttentionModule):
    """``LayerNorm(x + dropout(dense(attention(x))))`` on this rank's heads: ``[b, s(/tp), h]`` ->
    ``([b, s(/tp), h], weights)``."""

    tp_plan = {"attention_dropout": TPDropout(always_split=True), "output_dropout": TPDropout(),
               "query": Colwise(), "key": Colwise(), "value": Colwise(), "dense": Rowwise(),
               "LayerNorm": SequenceParallelNorm()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.scaling = self.attention_head_size ** -0.5
        self.attention_dropout = Dropout(config.attention_probs_dropout_prob)
        self.output_dropout = Dropout(config.hidden_dropout_prob)
        self.query = Linear(config.hidden_size, config.hidden_size)
        self.key = Linear(config.hidden_size, config.hidden_size)
        self.value = Linear(config.hidden_size, config.hidden_size)
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.is_causal = False

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        query, key, value = (split_heads(proj(hidden_states), self.attention_head_size)
                             for proj in (self.query, self.key, self.value))  # [b, n/tp, s, d]
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.attention_dropout,
                              scaling=self.scaling, eager_fallback=eager_attention_forward, **kwargs)
        return self.LayerNorm(hidden_states + self.output_dropout(self.dense(out))), weights


class AlbertLayer(nn.Module):
    """``a = attention(x)``, then ``full_layer_layer_norm(a + ffn_output(act(ffn(a))))`` (``dropout`` is registered
    and, as in ``transformers``, unused)."""

    tp_plan = {"full_layer_layer_norm": SequenceParallelNorm(), **prefixed("attention", AlbertAttention.tp_plan),
               "ffn": Colwise(), "ffn_output": Rowwise(), "dropout": TPDropout()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("intermediate_size", config.intermediate_size)]

    def __init__(self, config):
        super().__init__()
        self.full_layer_layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = AlbertAttention(config)
        self.ffn = Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = Linear(config.intermediate_size, config.hidden_size)
        self.activation = ACT2FN[config.hidden_act]
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        attention_output, _ = self.attention(hidden_states, attention_mask, **kwargs)
        ffn_output = self.ffn_output(self.activation(self.ffn(attention_output)))  # [b, s, i/tp] -> reduced
        return self.full_layer_layer_norm(ffn_output + attention_output)


class AlbertLayerGroup(GradientCheckpointingLayer):
    """``inner_group_num`` layers run in turn: the unit the stack runs (once per layer of the depth it serves)."""

    def __init__(self, config, group_idx: int | None = None):
        super().__init__()
        self.albert_layers = nn.ModuleList([AlbertLayer(config) for _ in range(config.inner_group_num)])

    @classmethod
    def tp_plan(cls, components) -> dict:
        return {f"albert_layers.*.{pattern}": style for pattern, style in AlbertLayer.tp_plan.items()}

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                **kwargs):
        for layer in self.albert_layers:
            hidden_states = layer(hidden_states, attention_mask, **kwargs)
        return hidden_states


class AlbertTransformer(nn.Module):
    """The container of ``embedding_hidden_mapping_in`` (run by the embedding phase) and the layer groups (run by
    the stack), filled by the spec's parts."""


def embedding_hidden_mapping_in(config, options=None) -> Linear:
    """The replicated ``[e, h]`` projection after the embeddings."""
    return Linear(config.embedding_size, config.hidden_size)


def albert_pooler(config) -> Linear:
    """The pooler's ``[h, h]`` dense on the first token (``tanh`` after it: ``pooler_activation``)."""
    return Linear(config.hidden_size, config.hidden_size)


def tanh(config) -> nn.Tanh:
    return nn.Tanh()


ALBERT_SPEC = StackSpec(block=AlbertLayerGroup, components=dict(attn=AlbertAttention, layer=AlbertLayer),
                        embed_tokens="embeddings.word_embeddings", final_norm=None,
                        extra_plan={**prefixed("embeddings", AlbertEmbeddings.tp_plan),
                                    # a stream linear: replicated under 1D, a grid one under 2D/3D
                                    "encoder.embedding_hidden_mapping_in": StreamLinear()},
                        parts=(Embeddings("embeddings", AlbertEmbeddings), Container("encoder", AlbertTransformer),
                               Built("encoder.embedding_hidden_mapping_in", embedding_hidden_mapping_in),
                               Layers("encoder.albert_layer_groups", count="num_hidden_groups"),
                               Pooler("pooler", albert_pooler), Pooling("pooler_activation", tanh)),
                        # transformers records each inner layer's output, not the group's
                        outputs={"hidden_states": AlbertLayer})


class AlbertPreTrainedModel(BertPreTrainedModel):
    config_class = AlbertConfig
    config: AlbertConfig
    base_model_prefix = "albert"
    pipeline_stages = AlbertStages  # the depth over shared layer groups (pipeline_albert.py)

    @classmethod
    def validate_parallel_config(cls, config, parallel) -> None:
        """BERT's rules, and ZeRO-2/3 with pipeline stages refused where a rank runs a shared layer group at
        several depths (``pipeline_albert.check_sharded_pipeline`` says why)."""
        super().validate_parallel_config(config, parallel)
        check_sharded_pipeline(cls, config, parallel)
    stack_spec = ALBERT_SPEC


class AlbertModel(AlbertPreTrainedModel, BertModel):
    """Factorized embeddings, the shared layer groups over ``num_hidden_layers``, optional pooler;
    ``last_hidden_state [b, s, h]``, ``pooler_output [b, h]``."""

    hf_twin = transformers.AlbertModel
    output_class = BaseModelOutputWithPooling

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.pooler_activation(self.pooler(hidden[:, 0]))

    @classmethod
    def embedding_extras(cls, config) -> tuple[str, ...]:
        """What the embedding phase runs besides ``embeddings``: a pipeline's first stage keeps it."""
        return ("encoder.embedding_hidden_mapping_in",)

    def embedding_output(self, **inputs) -> torch.Tensor:
        return self.encoder.embedding_hidden_mapping_in(self.embeddings(**inputs))  # [b, s, e] -> [b, s, h]

    def _layers(self) -> list[nn.Module]:
        """The group each of the ``num_hidden_layers`` layers runs (``transformers``' index rule)."""
        groups = self.encoder.albert_layer_groups
        depth, num_groups = self.config.num_hidden_layers, self.config.num_hidden_groups
        return [groups[int(i / (depth / num_groups))] for i in range(depth)]


AlbertPreTrainedModel.base_model_class = AlbertModel


class AlbertMLMHead(nn.Module):
    """``decoder(LayerNorm(act(dense(x))))``: the transform replicated (``[b, s, h] -> [b, s, e]``), the decoder
    vocab-parallel (``[b, s, e] -> [b, s, V_padded/tp]``) with ``bias`` split alongside it."""

    tp_plan = {"": VocabBias(), "decoder": Colwise(vocab=True), "dense": StreamLinear(),
               "LayerNorm": SequenceParallelNorm()}

    def __init__(self, config):
        super().__init__()
        self.LayerNorm = LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.dense = Linear(config.hidden_size, config.embedding_size)
        self.decoder = Linear(config.embedding_size, config.vocab_size)
        self.activation = ACT2FN[config.hidden_act]

    def features(self, hidden_states):
        return self.LayerNorm(self.activation(self.dense(hidden_states)))

    def forward(self, hidden_states):
        return self.decoder(self.features(hidden_states))


class AlbertSOPHead(nn.Module):
    """Sentence-order logits ``[b, num_labels]`` from the pooled state, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dropout = Dropout(config.classifier_dropout_prob)
        self.classifier = Linear(config.hidden_size, config.num_labels)

    def forward(self, pooled_output):
        return self.classifier(self.dropout(pooled_output))


# ---------------------------------------------------------------------------------------------- heads
class AlbertForMaskedLM(ForMaskedLM, AlbertPreTrainedModel):
    """ALBERT with the MLM head ``predictions`` (see ``ForMaskedLM``)."""

    hf_twin = transformers.AlbertForMaskedLM
    head_name, head_class = "predictions", AlbertMLMHead
    _decoder_bias_owner = "predictions"
    capabilities = Capabilities(context_parallel=True)


class AlbertForPreTraining(ForMaskedLM, AlbertPreTrainedModel):
    """The MLM head (vocab-parallel, as ``AlbertForMaskedLM``) plus the replicated sentence-order head on the
    pooler; the loss is MLM + SOP when both ``labels`` and ``sentence_order_label`` are given."""

    accepts_packed, per_row_output = False, "the pooled first token's sentence-pair prediction"

    hf_twin = transformers.AlbertForPreTraining
    uses_pooler = True
    head_name, head_class = "predictions", AlbertMLMHead
    _decoder_bias_owner = "predictions"
    pipeline_adapter_class = None  # no pipeline stages for MLM + SOP

    def build_head(self, config) -> None:
        super().build_head(config)
        self.sop_classifier = AlbertSOPHead(config)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, sentence_order_label=None, gather_logits: bool = True, **kwargs):
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        local_logits = self.predictions(outputs.last_hidden_state)  # [b, s, V_padded/tp]
        sop_logits = self.sop_classifier(outputs.pooler_output)
        decoder = self.predictions.decoder
        loss = None
        if labels is not None and sentence_order_label is not None:
            loss = token_loss(local_logits, labels, decoder) + F.cross_entropy(
                sop_logits.view(-1, 2), sentence_order_label.view(-1))
        logits = full_logits(local_logits, decoder, gather_logits)
        return AlbertForPreTrainingOutput(loss=loss, prediction_logits=logits, sop_logits=sop_logits,
                                          **passed_on(outputs))


class AlbertForSequenceClassification(AlbertPooling, EncoderForSequenceClassification, AlbertPreTrainedModel):
    hf_twin = transformers.AlbertForSequenceClassification
    classifier_dropout = staticmethod(_classifier_dropout)


class AlbertForTokenClassification(EncoderForTokenClassification, AlbertPreTrainedModel):
    hf_twin = transformers.AlbertForTokenClassification
    classifier_dropout = staticmethod(_classifier_dropout)


class AlbertForQuestionAnswering(EncoderForQuestionAnswering, AlbertPreTrainedModel):
    hf_twin = transformers.AlbertForQuestionAnswering


class AlbertForMultipleChoice(AlbertPooling, ForMultipleChoice, AlbertPreTrainedModel):
    hf_twin = transformers.AlbertForMultipleChoice
    classifier_dropout = staticmethod(_classifier_dropout)
