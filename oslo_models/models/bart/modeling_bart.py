"""BART (``BartModel``, ``BartForConditionalGeneration``), written single-device on the shared stack with the module
tree and state-dict keys of ``transformers``' BART; the other heads are in ``heads_bart.py``.

Each of the encoder and the decoder is a ``TransformerStack`` (``common/stack/stack.py``: its phases run the model's
``forward`` and every pipeline stage alike, ``pipeline_bart.py``), declared by a ``StackSpec``:

- token embeddings (``embed_tokens``, tied to ``shared``; vocab-parallel: one all-reduce) times ``embed_scale``
  (``sqrt(d_model)`` when ``config.scale_embedding``, else 1), plus learned positions with offset 2
  (``common/embeddings/positions.py``, rows ``past + arange(s) + 2``, replicated), then the scatter to ``[b, s/tp, d]``
  under sequence parallelism, ``layernorm_embedding`` and the embedding ``dropout``;
- post-norm layers (``layers_bart.py``); no final norm, so the stack's finish is only the gather back to
  ``[b, s, d]``;
- masks: bidirectional (padding) in the encoder; causal in the decoder (with the cached length), plus the
  cross-attention's padding mask over the encoder output, built once per forward and passed to every layer.

The sequence-parallel region is switched on by each stack for its own forward (each decides on its own length), so
the encoder output the decoder's cross-attention reads is full and replicated.

``BartForConditionalGeneration``: ``lm_head`` (vocab-parallel, tied to ``shared`` when ``tie_word_embeddings``) plus
``final_logits_bias``, a ``[1, V]`` buffer as in ``transformers`` (same state-dict key, saved whole; each rank adds
its vocabulary slice to its logits). Under the grid modes (2D / 2.5D / 3D) the slice is that of the logit columns
the grid head's rank holds (``lm_head.vocab_start_index``: the grid row's block, the cube's ``y`` block), its rows
being whatever batch block the head's output has. The buffer stays whole on every rank (V floats next to the head's
``V h / q**2``; buffers are never split, ``conversion/loading.py``), so loading, saving and checkpoints read it as
at 1D and adding it costs no collective. The loss runs on the vocab-split logits (no shift); ``logits`` are gathered to
``[b, s_dec, V]`` unless ``gather_logits=False``.

Context parallelism (``BartModel``, ``BartForConditionalGeneration``): each cp rank holds its chunk(s) of the source
*and* of the target (``ContextParallelSplitter`` splits the two lengths apart); the encoder's bidirectional and the
decoder's causal self-attention run the context-parallel core (ring / all-to-all over the stack's
``ContextParallelMask``, learned positions at the tokens' global positions); the decoder's cross-attention reads the
whole encoder output, gathered once per forward from the chunks (``parallel_layers/context_parallel/cross.py``: one
all-gather of ``[b, s_enc_local, d]`` and of the padding mask; backward one all-reduce of ``[b, s_enc, d]``); the
loss is the mean over the labelled tokens of the whole target (count and sum all-reduced over cp). The decoder
inputs must come from the full target (``decoder_input_ids`` in the batch: a chunk cannot shift its labels).

Shapes: b batch, s sequence, d d_model, n heads (n/tp per rank), V vocabulary.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.utils.generic import ModelOutput, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ...config import ParallelConfig
from ...parallel_layers.context_parallel.cross import gather_encoder_mask, gather_encoder_states
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ...parallel_layers.plan import Colwise, ParallelPlan, VocabEmbedding
from ..common.attention.cache_names import MASK_CACHE_KEYWORD, cache_field, output_cache, seq2seq_fields
from ..common.attention.causal_masks import FULL
from ..common.attention.cross_attention import self_attention_cache
from ..common.embeddings.positions import LearnedPositionalEmbedding, LearnedPositions
from ..common.loss.head_rules import SEQ2SEQ_LM
from ..common.loss.lm_loss import full_logits
from ..common.norms.layer_norm import LayerNorm
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import check_rules
from ..common.stack.context_parallel import context_parallel_loss, context_parallel_loss_items
from ..common.stack.outputs import capture_parallel_outputs
from ..common.stack.stack import StackSpec, TransformerStack
from ..modeling_utils import OsloPreTrainedModel
from .configuration_bart import BartConfig
from .layers_bart import BartAttention, BartDecoderLayer, BartEncoderLayer, BartFeedForward
from .pipeline_bart import BartPipelineAdapter

# extra_plan: the learned positions (offset 2) keep their row arithmetic under the grid modes
_STACK_PARTS = dict(embed_tokens="embed_tokens", position_embedding="embed_positions", layers="layers",
                    final_norm=None, embedding_norm="layernorm_embedding", embedding_dropout="dropout",
                    norm=LayerNorm, extra_plan={"embed_positions": LearnedPositions()})
BART_ENCODER_SPEC = StackSpec(block=BartEncoderLayer, components=dict(
    attn=BartAttention, attn_norm=LayerNorm, mlp=BartFeedForward, mlp_norm=LayerNorm), **_STACK_PARTS)
BART_DECODER_SPEC = StackSpec(block=BartDecoderLayer, components=dict(
    attn=BartAttention, attn_norm=LayerNorm, cross_attn=BartAttention, cross_attn_norm=LayerNorm,
    mlp=BartFeedForward, mlp_norm=LayerNorm), **_STACK_PARTS)


def bart_styles(prefix: str = "") -> dict:
    """The plan of a ``BartModel`` at ``prefix``: ``shared`` vocab-parallel, each stack's plan from its spec."""
    styles = {"shared": VocabEmbedding(), **BART_ENCODER_SPEC.plan("encoder").styles,
              **BART_DECODER_SPEC.plan("decoder").styles}
    return {f"{prefix}.{pattern}" if prefix else pattern: style for pattern, style in styles.items()}


class BartPreTrainedModel(OsloPreTrainedModel):
    config_class = BartConfig
    config: BartConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_load_unexpected = ["encoder.version", "decoder.version"]
    _no_split_modules = ["BartEncoderLayer", "BartDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    #: the components whose divisibility rules ``validate_parallel_config`` checks (``common/rules/parallel_rules.py``)
    parallel_components = (BartAttention, BartFeedForward)
    #: why a head cannot run under the grid tensor-parallel modes (2D / 2.5D / 3D); ``None``: it can
    grid_refusal: str | None = None

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        rules = [rule for component in cls.parallel_components for rule in component.parallel_rules(config)]
        check_rules(dict.fromkeys(rules), config, parallel)
        if parallel.tensor_parallel_mode != "1d" and cls.grid_refusal:
            raise NotImplementedError(f"{cls.__name__} under tensor_parallel_mode={parallel.tensor_parallel_mode!r} "
                                      f"is not implemented: {cls.grid_refusal}; use '1d'")
        if parallel.context_parallel_size > 1 and parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("BART under context parallelism with pipeline_parallel_size > 1 is not "
                                      "implemented (untested); use one of them")
        layerdrop = max(config.encoder_layerdrop, config.decoder_layerdrop)
        if layerdrop and parallel.world_size > 1:
            raise NotImplementedError(f"BART's layerdrop={layerdrop} (skipping whole layers at random in training, "
                                      "a different draw on each rank) is not implemented in parallel: load the "
                                      "model with encoder_layerdrop=decoder_layerdrop=0")

    def bart_model(self):
        """The ``BartModel`` holding ``shared`` / ``encoder`` / ``decoder`` (``self``, or ``self.model``)."""
        inner = getattr(self, "model", None)
        return inner if isinstance(inner, BartModel) else self

    def tie_parallel_weights(self) -> None:
        """The stacks' ``embed_tokens`` are ``shared``; ``lm_head`` is too when ``tie_word_embeddings``. A
        pipeline stage may lack any of them (``None``); a tied head off the first stage is a copy the pipeline
        engine keeps equal."""
        base = self.bart_model()
        shared = getattr(base, "shared", None)
        if shared is None:
            return
        for stack in (getattr(base, "encoder", None), getattr(base, "decoder", None)):
            if stack is not None and getattr(stack, "embed_tokens", None) is not None:
                stack.embed_tokens.weight = shared.weight
        if getattr(self, "lm_head", None) is not None and self.config.tie_word_embeddings:
            self.lm_head.weight = shared.weight


class _BartStack(TransformerStack, BartPreTrainedModel):
    """One stack (see the module docstring): ``embed_tokens``, ``embed_positions``, ``layers``,
    ``layernorm_embedding`` (``transformers``' registration order) and the embedding ``dropout``."""

    layer_class: type
    num_layers_attr: str

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.embed_positions = LearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
        self.layers = nn.ModuleList([self.layer_class(config, layer_idx=i)
                                     for i in range(getattr(config, self.num_layers_attr))])
        self.layernorm_embedding = LayerNorm(config.d_model)
        self.dropout = Dropout(config.dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def embed(self, input_ids, inputs_embeds, position_ids, token_type_ids=None) -> torch.Tensor:
        """``embed_tokens(ids) * embed_scale`` (given ``inputs_embeds`` are taken as they are, as in
        ``transformers``) plus the learned positions: ``[b, s, d]`` on every TP rank."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale
        return super().embed(None, inputs_embeds, position_ids)

    def position_embeds(self, position_ids) -> torch.Tensor:
        return self.embed_positions(None, position_ids=position_ids)  # rows position_ids + 2


class BartEncoder(_BartStack):
    """The encoder stack. ``last_hidden_state``: ``[b, s_enc, d]``, full and replicated over TP."""

    stack_spec = BART_ENCODER_SPEC
    layer_class, num_layers_attr = BartEncoderLayer, "encoder_layers"
    causal = False  # under context parallelism: a bidirectional ContextParallelMask
    _can_record_outputs = {"hidden_states": BartEncoderLayer, "attentions": BartAttention}

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        return {FULL: create_bidirectional_mask(config=self.config, inputs_embeds=shape_like,
                                                attention_mask=attention_mask)}

    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                output_hidden_states=None, **kwargs) -> BaseModelOutput:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        like = inputs_embeds if inputs_embeds is not None else input_ids[..., None]
        inputs = self.stack_inputs(self._shape_only(like), attention_mask)
        return BaseModelOutput(last_hidden_state=self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds,
                                                                **kwargs))


class BartDecoder(_BartStack):
    """The decoder stack: causal self-attention with a cache, cross-attention over ``encoder_hidden_states``
    ``[b, s_enc, d]`` (full, replicated) when given. ``last_hidden_state``: ``[b, s_dec, d]``."""

    stack_spec = BART_DECODER_SPEC
    layer_class, num_layers_attr = BartDecoderLayer, "decoder_layers"
    _can_record_outputs = {
        "hidden_states": BartDecoderLayer,
        "attentions": OutputRecorder(BartAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(BartAttention, index=1, layer_name="encoder_attn"),
    }

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``transformers``' causal mask; without a padding mask, an all-ones one over ``past + s`` (as BART)."""
        cache = self_attention_cache(past_key_values)
        if attention_mask is None:
            past = cache.get_seq_length() if cache is not None else 0
            attention_mask = torch.ones(shape_like.shape[0], past + shape_like.shape[1], device=shape_like.device)
        return {FULL: create_causal_mask(config=self.config, inputs_embeds=shape_like, attention_mask=attention_mask,
                                         **{MASK_CACHE_KEYWORD: cache})}

    def cross_attention_mask(self, shape_like, encoder_attention_mask, encoder_hidden_states):
        """The cross-attention's padding mask ``[b, 1, s_dec, s_enc]`` (or ``None``), built once per forward."""
        if encoder_hidden_states is None:
            return None
        return create_bidirectional_mask(config=self.config, inputs_embeds=shape_like,
                                         attention_mask=encoder_attention_mask,
                                         encoder_hidden_states=encoder_hidden_states)

    def new_cache(self, encoder_hidden_states):
        if encoder_hidden_states is not None or self.config.is_encoder_decoder:
            return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))
        return DynamicCache(config=self.config)

    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                past_key_values=None, inputs_embeds=None, use_cache=None, cache=None, output_attentions=None,
                output_hidden_states=None, **kwargs) -> BaseModelOutputWithPastAndCrossAttentions:
        """``cache``: ``transformers``' new name of ``past_key_values``."""
        past_key_values = cache if past_key_values is None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of decoder_input_ids or decoder_inputs_embeds")
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache(encoder_hidden_states)
        like = self._shape_only(inputs_embeds if inputs_embeds is not None else input_ids[..., None])
        inputs = self.stack_inputs(like, attention_mask, None, past_key_values)
        hidden = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds,
                                encoder_hidden_states=encoder_hidden_states,
                                encoder_attention_mask=self.cross_attention_mask(like, encoder_attention_mask,
                                                                                 encoder_hidden_states), **kwargs)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden,
                                                         **cache_field(past_key_values if use_cache else None))


def as_encoder_output(encoder_outputs) -> ModelOutput:
    """A user's ``encoder_outputs`` tuple (``return_dict=False``) as the output object, as ``transformers``."""
    if isinstance(encoder_outputs, ModelOutput):
        return encoder_outputs
    return BaseModelOutput(last_hidden_state=encoder_outputs[0],
                           hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                           attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None)


class BartModel(BartPreTrainedModel):
    """``shared``, ``encoder``, ``decoder``. ``last_hidden_state``: the decoder's ``[b, s_dec, d]``."""

    hf_twin = transformers.BartModel
    parallel_plan = ParallelPlan(bart_styles())
    capabilities = Capabilities(context_parallel=True)
    _tied_weights_keys = {"decoder.embed_tokens.weight": "shared.weight",
                          "encoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.shared = Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.encoder = BartEncoder(config, parallel_context=self.parallel_context)
        self.decoder = BartDecoder(config, parallel_context=self.parallel_context)
        self.post_init()
        if not submodule:  # inside a head model, the head model applies the plan once
            self.finish_init()

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = value
        self.encoder.embed_tokens = self.shared
        self.decoder.embed_tokens = self.shared

    def get_encoder(self):
        return self.encoder

    def get_decoder(self):
        return self.decoder

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, inputs_embeds=None, decoder_inputs_embeds=None,
                use_cache=None, cache=None, **kwargs) -> Seq2SeqModelOutput:
        """As ``transformers``: without decoder inputs the decoder reads ``input_ids`` shifted right."""
        kwargs.pop("return_dict", None)
        past_key_values = cache if past_key_values is None else past_key_values
        context = self.parallel_context
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            if context.cp_size > 1:
                raise ValueError("BART under context parallelism needs decoder_input_ids (shifted on the full "
                                 "sequence before the split: a chunk cannot shift its own)")
            if input_ids is None:
                raise ValueError("If no `decoder_input_ids` or `decoder_inputs_embeds` are passed, `input_ids` "
                                 "cannot be `None`. Please pass either `input_ids` or `decoder_input_ids` or "
                                 "`decoder_inputs_embeds`.")
            decoder_input_ids = shift_tokens_right(input_ids, self.config.pad_token_id,
                                                   self.config.decoder_start_token_id)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
        encoder_outputs = as_encoder_output(encoder_outputs)
        # under cp every decoder chunk reads the whole encoder output (context_parallel/cross.py); else itself
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
                                       encoder_hidden_states=gather_encoder_states(encoder_outputs.last_hidden_state,
                                                                                   context),
                                       encoder_attention_mask=gather_encoder_mask(attention_mask, context),
                                       past_key_values=past_key_values,
                                       inputs_embeds=decoder_inputs_embeds, use_cache=use_cache, return_dict=True,
                                       **kwargs)
        return Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state, **cache_field(output_cache(decoder_outputs)),
            decoder_hidden_states=decoder_outputs.hidden_states, decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions)


class BartForConditionalGeneration(BartPreTrainedModel, GenerationMixin):
    """BART with the vocab-parallel LM head plus ``final_logits_bias`` (see the module docstring); pipeline stages
    cut across encoder and decoder: ``pipeline_bart.py``."""

    hf_twin = transformers.BartForConditionalGeneration
    parallel_plan = ParallelPlan({**bart_styles("model"), "lm_head": Colwise(vocab=True)})
    pipeline_adapter = BartPipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_bart.py
    capabilities = Capabilities(context_parallel=True)
    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _keys_to_ignore_on_load_missing = ["final_logits_bias"]
    # a buffer, read by ``load_from_reader`` (the parameter loader would call it unused)
    _keys_to_ignore_on_load_unexpected = [*BartPreTrainedModel._keys_to_ignore_on_load_unexpected, "final_logits_bias"]

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.model = BartModel(config, parallel_context=self.parallel_context, submodule=True)
        self.register_buffer("final_logits_bias", torch.zeros((1, config.vocab_size)))
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()
        self.finish_init()

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def get_input_embeddings(self):
        return self.model.shared

    def get_output_embeddings(self):
        return self.lm_head

    def get_encoder(self):
        return self.model.encoder

    def get_decoder(self):
        return self.model.decoder

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        """The parameters, then the ``final_logits_bias`` buffer (whole, replicated; zeros when the checkpoint has
        none, as ``transformers``): the loader reads parameters only."""
        info = super().load_from_reader(reader, progress=progress, **options)
        with torch.no_grad():
            self.final_logits_bias.zero_()
            key = next((k for k in ("final_logits_bias", "model.final_logits_bias") if k in set(reader.keys())), None)
            if key is not None:
                stored = reader.read(key)
                self.final_logits_bias[:, :stored.shape[-1]].copy_(stored[..., :self.final_logits_bias.shape[-1]])
        return info

    def local_logits_bias(self, width: int) -> torch.Tensor:
        """This rank's ``[width]`` slice of ``final_logits_bias`` (the vocabulary slice of the vocab-parallel
        ``lm_head``, 1D or grid, zeros on its padded columns)."""
        bias = self.final_logits_bias[0]
        start = getattr(self.lm_head, "vocab_start_index", 0) if self.lm_head is not None else 0
        bias = F.pad(bias, (0, max(0, start + width - bias.shape[0])))
        return bias[start:start + width]

    def head_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``lm_head(h) + final_logits_bias``: this rank's ``[..., V_padded/tp]`` (padded columns ``-inf``)."""
        local = self.lm_head(hidden_states)
        return local + self.local_logits_bias(local.shape[-1]).to(local.dtype)

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, inputs_embeds=None, decoder_inputs_embeds=None,
                labels=None, use_cache=None, cache=None, gather_logits: bool = True, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs) -> Seq2SeqLMOutput:
        if labels is not None:
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                if self.parallel_context.cp_size > 1:
                    raise ValueError("BART under context parallelism needs decoder_input_ids with labels (shifted "
                                     "on the full sequence before the split: a chunk cannot shift its own labels)")
                decoder_input_ids = shift_tokens_right(labels, self.config.pad_token_id,
                                                       self.config.decoder_start_token_id)
        if skip_logits and labels is None:
            raise ValueError("skip_logits=True returns only the loss, so it needs labels")
        outputs = self.model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                             encoder_outputs=encoder_outputs, decoder_attention_mask=decoder_attention_mask,
                             past_key_values=cache if past_key_values is None else past_key_values,
                             inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds,
                             use_cache=use_cache, return_dict=True, **kwargs)
        local_logits = self.head_logits(outputs.last_hidden_state)
        loss = None
        if labels is not None:  # on the vocab-split logits, no shift (transformers' CrossEntropyLoss); under cp the
            # mean over the whole target's labelled tokens (count and sum over cp)
            count = context_parallel_loss_items(self, labels, num_items_in_batch, causal=False)
            loss = context_parallel_loss(self, SEQ2SEQ_LM.loss(self, local_logits, labels, count))
        logits = None if skip_logits else full_logits(local_logits, self.lm_head, gather_logits)
        return Seq2SeqLMOutput(loss=loss, logits=logits, **seq2seq_fields(outputs))

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)
