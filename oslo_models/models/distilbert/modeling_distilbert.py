"""DistilBERT on the shared stack, with ``transformers``' module tree and keys.

The base model is BERT's (``BertModel``: the stack's phases, the bidirectional mask, the embeddings run replicated
before the sequence-parallel scatter and the gather after the last layer) over DistilBERT's modules:

- ``embeddings``: word + position tables (no token types; the position table is learned, or initialized with the
  sinusoid under ``sinusoidal_pos_embds``: ``transformers`` v5 keeps it trainable, so only the initialization
  differs and it comes from the checkpoint or the twin), LayerNorm (eps 1e-12), dropout;
- ``transformer.layer.N`` (``TransformerBlock``): the post-norm template (``sa_layer_norm(x + attention(x))``, then
  ``output_layer_norm(h + ffn(h))``) over ``DistilBertSelfAttention`` (``q_lin``/``k_lin``/``v_lin``
  column-parallel: rank r owns heads ``r*n/tp .. (r+1)*n/tp``; ``out_lin`` row-parallel: all-reduce, or
  reduce-scatter under sequence parallelism) and the two-layer ``ffn`` (``lin1`` column-, ``lin2`` row-parallel,
  the shared ``DenseMLP`` under DistilBERT's names);
- the MLM head on the model itself (``vocab_transform``, activation, ``vocab_layer_norm``: replicated;
  ``vocab_projector``: the vocab-parallel decoder tied to the word embeddings, with its own bias split like its
  rows); the classification heads are replicated and read the first token (``pre_classifier``, ReLU, dropout,
  ``classifier``).

Shapes: b batch, s sequence (``/tp`` inside the layers under sequence parallelism), h = ``dim``, n heads, d head dim,
V vocabulary.
"""
from __future__ import annotations

import torch
import transformers
from torch import nn
from transformers.activations import get_activation
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.distilbert.modeling_distilbert import eager_attention_forward
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, Embedding, LayerNorm, Linear
from ...parallel_layers.plan import (
    Colwise,
    PositionEmbedding,
    Rowwise,
    SequenceParallelNorm,
    StreamLinear,
    TPDropout,
    VocabEmbedding,
)
from ..bert.modeling_bert import BertEmbeddings, BertModel, BertPreTrainedModel
from ..bert.parallel_plan import prefixed
from ..common import attend, split_heads
from ..common.attention.attention import AttentionModule
from ..common.feed_forward.mlp import DenseMLP
from ..common.norms.layer_norm import LayerNorm as StreamLayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Heads
from ..common.stack.blocks import PostNormBlock
from ..common.stack.stack import StackSpec
from ..common.stack.stack_parts import Container, Embeddings, Layers
from ..encoder_heads import (
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    ForMaskedLM,
    ForMultipleChoice,
)
from ..heads import flatten_choices, multiple_choice_output, question_answering_output
from .configuration_distilbert import DistilBertConfig

_EPS = 1e-12  # transformers' DistilBERT LayerNorms


class DistilBertEmbeddings(BertEmbeddings):
    """word + position embeddings, LayerNorm, dropout: ``[b, s]`` ids -> ``[b, s, h]`` (no token types)."""

    tp_plan = {"word_embeddings": VocabEmbedding(), "position_embeddings": PositionEmbedding(),
               "LayerNorm": SequenceParallelNorm(), "dropout": TPDropout()}

    def __init__(self, config):
        nn.Module.__init__(self)
        self.word_embeddings = Embedding(config.vocab_size, config.dim, padding_idx=config.pad_token_id)
        self.position_embeddings = Embedding(config.max_position_embeddings, config.dim)
        self.LayerNorm = LayerNorm(config.dim, eps=_EPS)
        self.dropout = Dropout(config.dropout)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values_length: int = 0) -> torch.Tensor:
        if token_type_ids is not None:
            raise ValueError("DistilBERT has no token type embeddings: pass no token_type_ids")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # vocab-parallel: all-reduce over TP
        if position_ids is None:
            position_ids = self.make_position_ids(input_ids, inputs_embeds, past_key_values_length)
        return self.dropout(self.LayerNorm(inputs_embeds + self.position_embeddings(position_ids)))


class DistilBertSelfAttention(AttentionModule):
    """Bidirectional attention on this rank's heads and the output projection: ``[b, s(/tp), h]`` ->
    ``([b, s(/tp), h], weights)``."""

    tp_plan = {"q_lin": Colwise(), "k_lin": Colwise(), "v_lin": Colwise(), "out_lin": Rowwise(),
               "dropout": TPDropout(always_split=True)}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("n_heads", config.n_heads)]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.n_heads, self.dim = config.n_heads, config.dim
        self.attention_head_size = config.dim // config.n_heads
        self.scaling = self.attention_head_size ** -0.5
        self.q_lin = Linear(config.dim, config.dim)
        self.k_lin = Linear(config.dim, config.dim)
        self.v_lin = Linear(config.dim, config.dim)
        self.out_lin = Linear(config.dim, config.dim)
        self.dropout = Dropout(config.attention_dropout)
        self.is_causal = False

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                **kwargs):
        query, key, value = (split_heads(proj(hidden_states), self.attention_head_size)
                             for proj in (self.q_lin, self.k_lin, self.v_lin))  # [b, n/tp, s, d]
        out, weights = attend(self, query, key, value, attention_mask, dropout=self.dropout, scaling=self.scaling,
                              eager_fallback=eager_attention_forward, **kwargs)
        return self.out_lin(out), weights


class DistilBertFFN(DenseMLP):
    """``dropout(lin2(act(lin1(x))))``: ``lin1`` column-, ``lin2`` row-parallel (``DenseMLP``)."""

    names = ("lin1", "lin2")
    intermediate_attr = "hidden_dim"


class DistilBertLayerNorm(StreamLayerNorm):
    """The residual stream's LayerNorm (sequence-parallel aware)."""


class TransformerBlock(PostNormBlock):
    """``sa_layer_norm(x + attention(x))``, then ``output_layer_norm(h + ffn(h))``."""

    names = dict(attn="attention", attn_norm="sa_layer_norm", mlp="ffn", mlp_norm="output_layer_norm")

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__(attn=DistilBertSelfAttention(config), attn_norm=DistilBertLayerNorm(config.dim, eps=_EPS),
                         mlp=DistilBertFFN(config.dim, config.hidden_dim, act=config.activation,
                                           dropout=config.dropout),
                         mlp_norm=DistilBertLayerNorm(config.dim, eps=_EPS))


class DistilBertTransformer(nn.Module):
    """The layers' container under ``transformers``' name (``transformer.layer.N``: the spec's ``Layers`` part
    fills it); the stack runs them."""


DISTILBERT_SPEC = StackSpec(block=TransformerBlock,
                            components=dict(attn=DistilBertSelfAttention, attn_norm=DistilBertLayerNorm,
                                            mlp=DistilBertFFN, mlp_norm=DistilBertLayerNorm),
                            embed_tokens="embeddings.word_embeddings", final_norm=None,
                            extra_plan=prefixed("embeddings", DistilBertEmbeddings.tp_plan),
                            parts=(Embeddings("embeddings", DistilBertEmbeddings),
                                   Container("transformer", DistilBertTransformer),
                                   Layers("transformer.layer", count="n_layers")))


class DistilBertPreTrainedModel(BertPreTrainedModel):
    config_class = DistilBertConfig
    config: DistilBertConfig
    base_model_prefix = "distilbert"
    stack_spec = DISTILBERT_SPEC


class DistilBertModel(DistilBertPreTrainedModel, BertModel):
    """Embeddings and ``n_layers`` post-norm layers; ``last_hidden_state [b, s, h]`` (no pooler)."""

    hf_twin = transformers.DistilBertModel
    output_class = BaseModelOutput


DistilBertPreTrainedModel.base_model_class = DistilBertModel


# ---------------------------------------------------------------------------------------------- heads
class DistilBertForMaskedLM(ForMaskedLM, DistilBertPreTrainedModel):
    """``vocab_projector(vocab_layer_norm(act(vocab_transform(h))))``, the projector vocab-parallel (see
    ``ForMaskedLM``); pipeline stages as BERT's, the last one holding the head's modules."""

    hf_twin = transformers.DistilBertForMaskedLM
    decoder_path = "vocab_projector"
    mlm_head_modules = ("vocab_transform", "activation", "vocab_layer_norm")
    head_styles = {"vocab_transform": StreamLinear(), "vocab_layer_norm": SequenceParallelNorm(),
                   "vocab_projector": Colwise(vocab=True)}
    capabilities = Capabilities(context_parallel=True)

    def build_head(self, config) -> None:
        self.activation = get_activation(config.activation)
        self.vocab_transform = Linear(config.dim, config.dim)
        self.vocab_layer_norm = LayerNorm(config.dim, eps=_EPS)
        self.vocab_projector = Linear(config.dim, config.vocab_size)

    @classmethod
    def mlm_transform(cls, holder, hidden):
        return holder.vocab_layer_norm(holder.activation(holder.vocab_transform(hidden)))


class _FirstTokenClassifier:
    """DistilBERT's classifier on the first token: ``classifier(dropout(relu(pre_classifier(h[:, 0]))))``,
    replicated."""

    uses_pooler = False

    def build_classifier(self, config, num_outputs: int) -> None:
        self.pre_classifier = Linear(config.dim, config.dim)
        self.classifier = Linear(config.dim, num_outputs)
        self.dropout = Dropout(config.seq_classif_dropout)

    def first_token_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.dropout(torch.relu(self.pre_classifier(hidden[:, 0]))))


class DistilBertForSequenceClassification(_FirstTokenClassifier, EncoderForSequenceClassification,
                                          DistilBertPreTrainedModel):
    hf_twin = transformers.DistilBertForSequenceClassification

    def build_head(self, config) -> None:
        self.num_labels = config.num_labels
        self.build_classifier(config, config.num_labels)

    def classify(self, outputs):
        return self.first_token_logits(outputs.last_hidden_state)


class DistilBertForTokenClassification(EncoderForTokenClassification, DistilBertPreTrainedModel):
    hf_twin = transformers.DistilBertForTokenClassification
    classifier_dropout = staticmethod(lambda config: config.dropout)


class DistilBertForQuestionAnswering(EncoderForQuestionAnswering, DistilBertPreTrainedModel):
    """The span head after a ``qa_dropout`` dropout."""

    hf_twin = transformers.DistilBertForQuestionAnswering
    span_dropout = True

    def build_head(self, config) -> None:
        super().build_head(config)
        self.dropout = Dropout(config.qa_dropout)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                start_positions=None, end_positions=None, **kwargs):
        outputs = self.encode(input_ids, attention_mask, None, position_ids, inputs_embeds, **kwargs)
        logits = self.qa_outputs(self.dropout(outputs.last_hidden_state))
        return question_answering_output(logits, start_positions, end_positions, outputs)


class DistilBertForMultipleChoice(_FirstTokenClassifier, ForMultipleChoice, DistilBertPreTrainedModel):
    hf_twin = transformers.DistilBertForMultipleChoice

    def build_head(self, config) -> None:
        self.build_classifier(config, 1)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                **kwargs):
        num_choices = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        outputs = self.encode(*flatten_choices(input_ids, attention_mask, None, position_ids, inputs_embeds),
                              **kwargs)
        return multiple_choice_output(self.first_token_logits(outputs.last_hidden_state), labels, num_choices,
                                      outputs)
