"""ELECTRA: BERT's encoder (imported, not copied: ``BERT_SPEC``'s layers, plan, stack and pipeline stages) with
what differs, and nothing else:

- the embeddings are ``embedding_size`` wide (word, position and token-type tables, LayerNorm, dropout), and, when
  that differs from ``hidden_size``, ``embeddings_project`` (a replicated ``[e, h]`` linear) maps them to the hidden
  width. Both run in the embedding phase, on the full ``[b, s, e]`` before the sequence-parallel scatter, so the
  projection's gradient is the same on every TP rank; a pipeline's first stage keeps it (``embedding_extras``);
- no pooler;
- the generator's MLM head (``ElectraForMaskedLM``): ``generator_predictions`` (``[h, e]`` dense, GELU, LayerNorm,
  replicated) then ``generator_lm_head``, the vocab-parallel ``[V, e]`` decoder tied to the word embeddings with its
  own bias (split like its rows): ``[b, s, e] -> [b, s, V_padded/tp]``;
- the discriminator's head (``ElectraForPreTraining``): replicated ``discriminator_predictions`` -> one logit per
  token ``[b, s]``, binary cross-entropy over the attended tokens;
- the sequence classifier on the first token (dense, GELU, ``out_proj``) and the multiple-choice
  ``sequence_summary`` (``transformers``' own summary module: first token, projection, activation, dropouts).

Shapes: b batch, s sequence, h hidden, e embedding width, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import get_activation
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.electra.modeling_electra import ElectraForPreTrainingOutput, ElectraSequenceSummary
from transformers.utils.generic import can_return_tuple

from ...parallel_layers.layers import Dropout, LayerNorm, Linear
from ...parallel_layers.plan import Colwise, SequenceParallelNorm, StreamLinear
from ..bert.modeling_bert import BertEmbeddings, BertModel, BertPreTrainedModel, encoder_spec
from ..bert.parallel_plan import prefixed
from ..common.rules.capabilities import Capabilities
from ..common.stack.outputs import passed_on
from ..common.stack.stack_parts import Built
from ..encoder_heads import (
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    EncoderHeadModel,
    ForMaskedLM,
    ForMultipleChoice,
    classifier_dropout,
)
from .configuration_electra import ElectraConfig


class ElectraEmbeddings(BertEmbeddings):
    """BERT's embeddings ``embedding_size`` wide: ``[b, s]`` ids -> ``[b, s, e]``."""

    width_attribute = "embedding_size"


def embeddings_project(config, options=None) -> Linear | None:
    """The replicated ``[e, h]`` projection after the embeddings; ``None`` when ``e == h``."""
    projected = config.embedding_size != config.hidden_size
    return Linear(config.embedding_size, config.hidden_size) if projected else None


#: BERT's layers and plan over ELECTRA's embeddings, plus the projection (a stream linear: replicated under 1D, a
#: grid linear under 2D/3D); no pooler
ELECTRA_SPEC = encoder_spec(ElectraEmbeddings, Built("embeddings_project", embeddings_project),
                            extra_plan={"embeddings_project": StreamLinear()})


class ElectraPreTrainedModel(BertPreTrainedModel):
    config_class = ElectraConfig
    config: ElectraConfig
    base_model_prefix = "electra"
    stack_spec = ELECTRA_SPEC


class ElectraModel(ElectraPreTrainedModel, BertModel):
    """Embeddings (``[b, s, e]``), ``embeddings_project`` to ``[b, s, h]`` when ``e != h``, BERT's layers; no
    pooler (``add_pooling_layer`` is accepted and ignored, as the encoder heads pass it)."""

    hf_twin = transformers.ElectraModel
    output_class = BaseModelOutputWithPastAndCrossAttentions

    @classmethod
    def embedding_extras(cls, config) -> tuple[str, ...]:
        return ("embeddings_project",) if config.embedding_size != config.hidden_size else ()

    def embedding_output(self, **inputs) -> torch.Tensor:
        hidden = self.embeddings(**inputs)  # [b, s, e]
        return self.embeddings_project(hidden) if self.embeddings_project is not None else hidden  # [b, s, h]


ElectraPreTrainedModel.base_model_class = ElectraModel


class ElectraGeneratorPredictions(nn.Module):
    """The generator's transform before the decoder: ``LayerNorm(gelu(dense(x)))``, ``[b, s, h] -> [b, s, e]``,
    replicated (grid layers under 2D/3D)."""

    tp_plan = {"dense": StreamLinear(), "LayerNorm": SequenceParallelNorm()}

    def __init__(self, config):
        super().__init__()
        self.activation = get_activation("gelu")
        self.LayerNorm = LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dense = Linear(config.hidden_size, config.embedding_size)

    def features(self, hidden_states):
        return self.LayerNorm(self.activation(self.dense(hidden_states)))

    forward = features


class ElectraDiscriminatorPredictions(nn.Module):
    """``dense_prediction(act(dense(x))).squeeze(-1)``: one replaced-token logit per position, ``[b, s]``."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.activation = get_activation(config.hidden_act)
        self.dense_prediction = Linear(config.hidden_size, 1)

    def forward(self, hidden_states):
        return self.dense_prediction(self.activation(self.dense(hidden_states))).squeeze(-1)


class ElectraClassificationHead(nn.Module):
    """``out_proj(dropout(gelu(dense(dropout(h[:, 0])))))``, replicated (RoBERTa's head with GELU for tanh)."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.activation = get_activation("gelu")
        self.dropout = Dropout(classifier_dropout(config))
        self.out_proj = Linear(config.hidden_size, config.num_labels)

    def forward(self, features):
        x = self.dropout(features[:, 0, :])
        return self.out_proj(self.dropout(self.activation(self.dense(x))))


# ---------------------------------------------------------------------------------------------- heads
class ElectraForMaskedLM(ForMaskedLM, ElectraPreTrainedModel):
    """The generator: ``generator_predictions`` then the vocab-parallel ``generator_lm_head`` (see ``ForMaskedLM``);
    pipeline stages as BERT's."""

    hf_twin = transformers.ElectraForMaskedLM
    head_name, head_class = "generator_predictions", ElectraGeneratorPredictions
    decoder_path = "generator_lm_head"
    head_styles = {**prefixed("generator_predictions", ElectraGeneratorPredictions.tp_plan),
                   "generator_lm_head": Colwise(vocab=True)}
    capabilities = Capabilities(context_parallel=True)

    def build_head(self, config) -> None:
        super().build_head(config)
        self.generator_lm_head = Linear(config.embedding_size, config.vocab_size)


class ElectraForPreTraining(EncoderHeadModel, ElectraPreTrainedModel):
    """The discriminator: one logit per token (``[b, s]``, replicated head on the full sequence); with ``labels``
    (1 = replaced) the binary cross-entropy over the tokens ``attention_mask`` keeps, as ``transformers``."""

    hf_twin = transformers.ElectraForPreTraining
    accepts_packed = True  # one logit per token: the packed row's are its documents'

    def build_head(self, config) -> None:
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, **kwargs) -> ElectraForPreTrainingOutput:
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        logits = self.discriminator_predictions(outputs.last_hidden_state)  # [b, s]
        loss = None
        if labels is not None:
            if attention_mask is not None:
                active = attention_mask.view(-1, logits.shape[1]) == 1
                loss = F.binary_cross_entropy_with_logits(logits[active], labels[active].float())
            else:
                loss = F.binary_cross_entropy_with_logits(logits, labels.float())
        return ElectraForPreTrainingOutput(loss=loss, logits=logits, **passed_on(outputs))


class ElectraForSequenceClassification(EncoderForSequenceClassification, ElectraPreTrainedModel):
    hf_twin = transformers.ElectraForSequenceClassification
    head_class = ElectraClassificationHead


class ElectraForTokenClassification(EncoderForTokenClassification, ElectraPreTrainedModel):
    hf_twin = transformers.ElectraForTokenClassification


class ElectraForQuestionAnswering(EncoderForQuestionAnswering, ElectraPreTrainedModel):
    hf_twin = transformers.ElectraForQuestionAnswering


class ElectraForMultipleChoice(ForMultipleChoice, ElectraPreTrainedModel):
    """One score per choice from ``sequence_summary`` (first token, projection, activation, dropouts: ``[b*c, h]``)
    and the replicated ``classifier``: ``logits [b, c]``."""

    hf_twin = transformers.ElectraForMultipleChoice
    uses_pooler = False
    pipeline_head_modules = {"sequence_summary": "sequence_summary", "classifier": "classifier"}

    def build_head(self, config) -> None:
        self.sequence_summary = ElectraSequenceSummary(config)
        self.classifier = Linear(config.hidden_size, 1)

    def head_logits(self, hidden, attention_mask=None, config=None):
        """``[b*c, s, h] -> [b*c, 1]``; run on the model or on a pipeline's last stage
        (``common/loss/head_rules.py``)."""
        return self.classifier(self.sequence_summary(hidden))
