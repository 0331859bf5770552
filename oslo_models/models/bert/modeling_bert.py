"""BERT, written single-device with the module tree and state-dict keys of ``transformers``' BERT.

The base model is the encoder stack (``common/stack/encoder_stack.py``), built from ``BERT_SPEC``'s parts: its phases
(``stack_inputs``, ``run_stack``) run the model's ``forward`` and every pipeline stage alike
(``common/pipeline/pipeline_encoder.py``). The encoder stack fills the shared stack's hooks: the
embeddings module (sum, LayerNorm, dropout: cheap and replicated, so it runs outside the sequence-parallel region,
before the scatter ``[b, s, h] -> [b, s/tp, h]``), the bidirectional mask (causal with a key/value cache when
``config.is_decoder``), no final norm (post-norm layers), and the gather back after the last layer, so pooler,
heads and every public tensor see HF's ``[batch, seq, hidden]``. Sequence parallelism is switched on for the
layers by the stack (the context's ``SequenceParallelRegion``); no layer takes a ``sequence_parallel`` argument.
The q/k/v projections are three column-parallel layers (as in the checkpoint), so under sequence parallelism each
gathers the sequence on its own: three all-gathers forward, three reduce-scatters backward per layer.

The parallel plan and the divisibility checks are derived from ``BERT_SPEC``'s components (the attention carries
its heads rule and plan fragment, the feed-forward its ``intermediate_size`` rule); the heads are the generic
encoder heads (``models/encoder_heads.py``); ``output_hidden_states`` / ``output_attentions`` are recorded by
``transformers``' own hooks (``common/stack/outputs.py``).

Shapes: b batch, s sequence, h hidden, n heads (n/tp per rank), d head dim, V vocabulary.
"""
from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ...config import ParallelConfig
from ...parallel_layers.head_parallel import VocabBias
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
from ..common import full_logits, token_loss
from ..common.feed_forward.bias_act import fused_gelu_approximation, linear_act
from ..common.loading.legacy_keys import legacy_key_view
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import Features, Heads, check_head_size
from ..common.stack.blocks import BlockTemplate
from ..common.stack.encoder_stack import EncoderStack
from ..common.stack.outputs import passed_on
from ..common.stack.stack import StackSpec
from ..common.stack.stack_parts import Container, Embeddings, Layers, Pooler
from ..encoder_heads import (
    EncoderForCausalLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
    EncoderForTokenClassification,
    ForMaskedLM,
    ForMultipleChoice,
    ForNextSentencePrediction,
)
from ..heads import StackFamilyModel
from ..modeling_utils import OsloPreTrainedModel
from .attention_bert import BertCrossAttention, BertSelfAttention
from .configuration_bert import BertConfig
from .parallel_plan import prefixed


def _activation(hidden_act):
    return ACT2FN[hidden_act] if isinstance(hidden_act, str) else hidden_act


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings, LayerNorm, dropout: ``[b, s]`` ids -> ``[b, s, h]``.

    The word embeddings are vocab-parallel (one all-reduce); everything else is replicated (the position and
    token-type tables are hidden-split under the 2D/2.5D grid modes). Position ids are ``past_length .. past_length
    + s - 1`` unless given (RoBERTa overrides ``make_position_ids`` and sets ``derives_positions``)."""

    tp_plan = {"word_embeddings": VocabEmbedding(), "position_embeddings": PositionEmbedding(),
               "token_type_embeddings": PositionEmbedding(),
               "LayerNorm": SequenceParallelNorm(),  # run outside the sequence-parallel region: a plain norm at 1D
               "dropout": TPDropout()}
    #: the position ids depend on ``input_ids`` (RoBERTa), so the stack's default positions do not apply
    derives_positions: ClassVar[bool] = False
    #: the config attribute of the embeddings' width (ELECTRA, ALBERT: ``embedding_size``, projected afterwards)
    width_attribute: ClassVar[str] = "hidden_size"

    def __init__(self, config):
        super().__init__()
        width = getattr(config, self.width_attribute)
        self.word_embeddings = Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.position_embeddings = Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = Embedding(config.type_vocab_size, width)
        self.LayerNorm = LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def make_position_ids(self, input_ids, inputs_embeds, past_length: int) -> torch.Tensor:
        seq_len = inputs_embeds.shape[1]
        return (torch.arange(seq_len, device=inputs_embeds.device) + past_length).unsqueeze(0)

    @classmethod
    def first_position(cls, config) -> int:
        """A sequence's first position id (RoBERTa: ``pad_token_id + 1``); packed documents start there."""
        return 0

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                past_key_values_length: int = 0) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)  # vocab-parallel: all-reduce over TP
        if position_ids is None:
            position_ids = self.make_position_ids(input_ids, inputs_embeds, past_key_values_length)
        if token_type_ids is None:
            token_type_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfOutput(nn.Module):
    """Row-parallel ``dense`` (all-reduce, or reduce-scatter under SP), dropout, post-LN residual."""

    tp_plan = {"dense": Rowwise(), "dropout": TPDropout(), "LayerNorm": SequenceParallelNorm()}

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dropout(self.dense(hidden_states)) + input_tensor)


class BertAttention(nn.Module):
    """``self`` (q/k/v column-parallel: rank r owns heads ``r*n/tp .. (r+1)*n/tp``) and ``output`` (row-parallel
    projection, residual, LayerNorm). Returns ``(output [b, s(/tp), h], weights)``."""

    tp_plan = {"self.query": Colwise(), "self.key": Colwise(), "self.value": Colwise(),
               "self.dropout": TPDropout(always_split=True), **prefixed("output", BertSelfOutput.tp_plan)}
    #: the kernels ``BertSelfAttention`` runs (``transformers``' ``_supports_<kernel>`` flags, derived from it)
    kernels = frozenset({"sdpa", "flash_attn", "flex_attn", "attention_backend"})

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Heads("num_attention_heads", config.num_attention_heads)]

    def __init__(self, config, layer_idx: int | None = None, is_cross_attention: bool = False):
        super().__init__()
        self.is_cross_attention = is_cross_attention
        self.self = (BertCrossAttention if is_cross_attention else BertSelfAttention)(config, layer_idx)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None,
                encoder_hidden_states=None, **kwargs):
        if self.is_cross_attention:
            kwargs["encoder_hidden_states"] = encoder_hidden_states
        attention_output, weights = self.self(hidden_states, attention_mask=attention_mask,
                                              past_key_values=past_key_values, **kwargs)
        return self.output(attention_output, hidden_states), weights


class BertIntermediate(nn.Module):
    """Column-parallel ``dense`` + activation: ``[b, s(/tp), h] -> [b, s, i/tp]``."""

    tp_plan = {"dense": Colwise()}

    @classmethod
    def parallel_rules(cls, config) -> list:
        return [Features("intermediate_size", config.intermediate_size)]

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        self.hidden_act = config.hidden_act if isinstance(config.hidden_act, str) else None
        self.intermediate_act_fn = _activation(config.hidden_act)
        self.fused_gelu = None  # bias_gelu's ``approximate`` when the fused bias-GELU runs (configure_fused_ops)

    def configure_fused_ops(self, enabled: bool) -> None:
        self.fused_gelu = fused_gelu_approximation(enabled, self.hidden_act, self.dense)

    def forward(self, hidden_states):
        return linear_act(self.dense, self.intermediate_act_fn, hidden_states, approximate=self.fused_gelu)


class BertOutput(BertSelfOutput):
    """Row-parallel ``dense`` from the intermediate size back to ``h``, dropout, post-LN residual."""

    def __init__(self, config):
        super().__init__(config)
        self.dense = Linear(config.intermediate_size, config.hidden_size)


class BertLayer(BlockTemplate):
    """Post-norm encoder layer in BERT's module tree, where each residual add and its LayerNorm live inside the
    sub-module that ends the branch: ``a = attention(x)`` (= ``attention.output.LayerNorm(x + attn(x))``), then
    ``output(intermediate(a), a)`` (= ``output.LayerNorm(a + ffn(a))``). ELECTRA's layer is the same tree.

    As a decoder with ``config.add_cross_attention`` (``EncoderDecoderModel``'s decoder), ``crossattention`` runs
    between them on ``encoder_hidden_states`` (``a = crossattention(a, encoder output)``, its own residual and
    LayerNorm), as ``transformers``."""

    roles = ("attn", "cross_attn", "intermediate", "output")
    optional_roles = ("cross_attn",)
    names = dict(attn="attention", cross_attn="crossattention", intermediate="intermediate", output="output")

    def __init__(self, config, layer_idx: int | None = None):
        cross = None
        if getattr(config, "add_cross_attention", False):
            if not config.is_decoder:
                raise ValueError(f"{type(self).__name__} should be used as a decoder model if cross attention is "
                                 "added")
            cross = BertAttention(config, layer_idx, is_cross_attention=True)
        super().__init__(attn=BertAttention(config, layer_idx), cross_attn=cross,
                         intermediate=BertIntermediate(config), output=BertOutput(config))

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, past_key_values=None, *,
                encoder_hidden_states=None, encoder_attention_mask=None, **kwargs):
        attention_output = self.attend(hidden_states, attention_mask, position_embeddings, past_key_values, **kwargs)
        if encoder_hidden_states is not None:
            cross = self.part("cross_attn")
            if cross is None:
                raise ValueError(f"If `encoder_hidden_states` are passed, {type(self).__name__} has to be "
                                 "instantiated with cross-attention layers by setting `config.add_cross_attention"
                                 "=True`")
            attention_output, _ = cross(attention_output, attention_mask=encoder_attention_mask,
                                        past_key_values=past_key_values,
                                        encoder_hidden_states=encoder_hidden_states, **kwargs)
        return self.output(self.intermediate(attention_output), attention_output)


class BertEncoder(nn.Module):
    """The layers' container under ``transformers``' name (``encoder.layer.N``: the spec's ``Layers`` part fills
    it); the stack runs them."""


class BertPooler(nn.Module):
    """``tanh(dense(h[:, 0]))``, replicated."""

    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


def encoder_parts(embeddings: type, *extra, pooler: type | None = None) -> tuple:
    """The parts of an encoder over BERT's layers, in ``transformers``' registration order: ``embeddings``, the
    ``extra`` parts (ELECTRA's ``embeddings_project``), ``encoder`` with its ``layer`` list, the ``pooler`` when the
    family has one (built with ``add_pooling_layer``)."""
    return (Embeddings("embeddings", embeddings), *extra, Container("encoder", BertEncoder), Layers("encoder.layer"),
            *((Pooler("pooler", pooler),) if pooler is not None else ()))


def encoder_spec(embeddings: type, *extra, pooler: type | None = None, **fields) -> StackSpec:
    """BERT's spec over another embeddings module (and ``extra`` parts, ``fields``): the layers, components, plan
    and recorded outputs are BERT's."""
    return StackSpec(block=BertLayer,
                     components=dict(attn=BertAttention, cross_attn=BertAttention, intermediate=BertIntermediate,
                                     output=BertOutput),
                     embed_tokens="embeddings.word_embeddings", final_norm=None,
                     extra_plan={**prefixed("embeddings", BertEmbeddings.tp_plan), **fields.pop("extra_plan", {})},
                     parts=encoder_parts(embeddings, *extra, pooler=pooler),
                     # as transformers' BERT: cross-attentions from the layers' ``crossattention`` (decoders with
                     # add_cross_attention)
                     outputs={"attentions": BertSelfAttention,
                              "cross_attentions": OutputRecorder(BertCrossAttention, index=1)}, **fields)


BERT_SPEC = encoder_spec(BertEmbeddings, pooler=BertPooler)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size)
        self.transform_act_fn = _activation(config.hidden_act)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states):
        return self.LayerNorm(self.transform_act_fn(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """Replicated transform, then the vocab-parallel ``decoder`` (weight tied to the word embeddings, bias tied
    to this module's ``bias``, split like the decoder's outputs): ``[b, s, h] -> [b, s, V_padded/tp]``."""

    tp_plan = {"": VocabBias(), "decoder": Colwise(vocab=True), "transform.dense": StreamLinear(),
               "transform.LayerNorm": SequenceParallelNorm()}

    #: the replicated transform; the decoder reads its ``dense`` outputs (DeBERTa's: ``embedding_size``)
    transform_class: type = BertPredictionHeadTransform

    def __init__(self, config):
        super().__init__()
        self.transform = self.transform_class(config)
        self.decoder = Linear(self.transform.dense.out_features, config.vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def features(self, hidden_states):
        """The replicated transform before the decoder: ``[b, s, h] -> [b, s, h]``."""
        return self.transform(hidden_states)

    def forward(self, hidden_states):
        return self.decoder(self.transform(hidden_states))


class BertOnlyMLMHead(nn.Module):
    tp_plan = prefixed("predictions", BertLMPredictionHead.tp_plan)
    prediction_class: type = BertLMPredictionHead

    def __init__(self, config):
        super().__init__()
        self.predictions = self.prediction_class(config)

    def features(self, sequence_output):
        return self.predictions.features(sequence_output)

    def forward(self, sequence_output):
        return self.predictions(sequence_output)


class BertPreTrainingHeads(BertOnlyMLMHead):
    def __init__(self, config):
        super().__init__(config)
        self.seq_relationship = Linear(config.hidden_size, 2)

    def forward(self, sequence_output, pooled_output):
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


class BertOnlyNSPHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.seq_relationship = Linear(config.hidden_size, 2)

    def forward(self, pooled_output):
        return self.seq_relationship(pooled_output)


class BertPreTrainedModel(StackFamilyModel, OsloPreTrainedModel):
    config_class = BertConfig
    config: BertConfig
    base_model_prefix = "bert"
    stack_spec = BERT_SPEC
    supports_gradient_checkpointing = True
    _decoder_bias_owner: ClassVar[str | None] = None  # the MLM head module whose ``bias`` the decoder shares

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        super().validate_parallel_config(config, parallel)  # the components' rules: heads, intermediate_size
        name = type(config).__name__.replace("Config", "")
        check_head_size(config, name)
        if getattr(config, "add_cross_attention", False) and parallel.tensor_parallel_mode != "1d":
            raise NotImplementedError(f"{name} with cross-attention (add_cross_attention) under tensor_parallel_mode="
                                      f"{parallel.tensor_parallel_mode!r} is not implemented: the grid layers take "
                                      "activations in batch/hidden blocks, and the encoder output reaches the "
                                      "cross-attention whole; use tensor_parallel_mode='1d'")
        if getattr(config, "add_cross_attention", False) and parallel.context_parallel_size > 1:
            raise NotImplementedError(f"{name} with cross-attention (add_cross_attention) under context_parallel_size="
                                      f"{parallel.context_parallel_size} is not implemented: the cross-attention "
                                      "mask and cache are built for whole decoder sequences; use "
                                      "context_parallel_size=1")

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        # LayerNorm.gamma/beta keys of old checkpoints
        return super().load_from_reader(legacy_key_view(reader), progress=progress, **options)

    def set_output_embeddings(self, new_embeddings) -> None:
        """The new decoder, and (as ``transformers``) the head's own ``bias`` becomes the decoder's bias."""
        super().set_output_embeddings(new_embeddings)
        head = dict(self.named_modules()).get(self._decoder_bias_owner) if self._decoder_bias_owner else None
        if head is not None:
            head.bias = new_embeddings.bias
            head.vocab_size = getattr(new_embeddings, "vocab_size", new_embeddings.out_features)

    def tie_parallel_weights(self) -> None:
        """Tie the decoder weight to the word embeddings and, as ``transformers`` does, the decoder bias to the
        head's own ``bias`` (both only when ``tie_word_embeddings``)."""
        super().tie_parallel_weights()
        if self._decoder_bias_owner and getattr(self.config, "tie_word_embeddings", False):
            head = dict(self.named_modules()).get(self._decoder_bias_owner)  # None off a pipeline's last stage
            if head is not None:
                head.decoder.bias = head.bias


class BertModel(EncoderStack, BertPreTrainedModel):
    """Built from ``BERT_SPEC``'s parts: embeddings, ``num_hidden_layers`` layers, the pooler when
    ``add_pooling_layer``; the forward is the encoder stack's (``common/stack/encoder_stack.py``).
    ``last_hidden_state``: ``[b, s, h]``; ``pooler_output``: ``[b, h]``.

    The other encoder families are this model over their own spec (their parts under ``transformers``' names),
    with two hooks where the tree needs them: ``embedding_output`` (ELECTRA's ``embeddings_project``, ALBERT's
    ``embedding_hidden_mapping_in`` after the embeddings, still outside the sequence-parallel region) with
    ``embedding_extras`` (those modules, for a pipeline's first stage), and ``pool`` (ALBERT's pooler)."""

    hf_twin = transformers.BertModel
    is_base_model = True
    capabilities = Capabilities(context_parallel=True)


BertPreTrainedModel.base_model_class = BertModel


# ---------------------------------------------------------------------------------------------- heads
class BertForMaskedLM(ForMaskedLM, BertPreTrainedModel):
    """BERT with the MLM head ``cls.predictions`` (see ``ForMaskedLM``); pipeline:
    ``common/pipeline/pipeline_encoder.py``."""

    hf_twin = transformers.BertForMaskedLM
    head_name, head_class = "cls", BertOnlyMLMHead
    _decoder_bias_owner = "cls.predictions"
    capabilities = Capabilities(context_parallel=True)


class BertLMHeadModel(EncoderForCausalLM, BertPreTrainedModel):
    """BERT as a causal decoder (``config.is_decoder``) over the MLM head (see ``EncoderForCausalLM``)."""

    hf_twin = transformers.BertLMHeadModel
    head_name, head_class = "cls", BertOnlyMLMHead
    _decoder_bias_owner = "cls.predictions"


class BertForPreTraining(ForMaskedLM, BertPreTrainedModel):
    """MLM head (vocab-parallel, as ``BertForMaskedLM``) plus the replicated next-sentence head on the pooler.
    The loss is MLM + NSP when both ``labels`` and ``next_sentence_label`` are given."""

    accepts_packed, per_row_output = False, "the pooled first token's sentence-pair prediction"

    hf_twin = transformers.BertForPreTraining
    uses_pooler = True
    head_name, head_class = "cls", BertPreTrainingHeads
    _decoder_bias_owner = "cls.predictions"
    pipeline_adapter_class = None  # no pipeline stages for MLM + NSP

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, gather_logits: bool = True, **kwargs):
        outputs = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, **kwargs)
        local_logits, seq_relationship = self.cls(outputs.last_hidden_state, outputs.pooler_output)
        decoder = self.cls.predictions.decoder
        loss = None
        if labels is not None and next_sentence_label is not None:
            loss = token_loss(local_logits, labels, decoder) + F.cross_entropy(
                seq_relationship.view(-1, 2), next_sentence_label.view(-1))
        return BertForPreTrainingOutput(loss=loss, prediction_logits=full_logits(local_logits, decoder, gather_logits),
                                        seq_relationship_logits=seq_relationship, **passed_on(outputs))


class BertForSequenceClassification(EncoderForSequenceClassification, BertPreTrainedModel):
    """Replicated ``classifier`` on the pooled ``[CLS]`` state; pipeline stages:
    ``common/pipeline/pipeline_encoder.py``."""

    hf_twin = transformers.BertForSequenceClassification


class BertForTokenClassification(EncoderForTokenClassification, BertPreTrainedModel):
    hf_twin = transformers.BertForTokenClassification


class BertForQuestionAnswering(EncoderForQuestionAnswering, BertPreTrainedModel):
    hf_twin = transformers.BertForQuestionAnswering


class BertForMultipleChoice(ForMultipleChoice, BertPreTrainedModel):
    hf_twin = transformers.BertForMultipleChoice


class BertForNextSentencePrediction(ForNextSentencePrediction, BertPreTrainedModel):
    hf_twin = transformers.BertForNextSentencePrediction
    head_name, head_class = "cls", BertOnlyNSPHead
