"""T5 (and T5 v1.1 / Flan-T5), written single-device with the module tree and state-dict keys of
``transformers``' T5.

Parallelism enters through the layers the plan (``parallel_plan.py``, from the components' ``tp_plan``) swaps in
and through the explicit sequence-parallel boundaries of each ``T5Stack``: after the token embeddings the residual
stream is scattered along the sequence (``[b, s, d] -> [b, s/tp, d]``), after the final norm and dropout it is
gathered back. Each stack switches the context's ``SequenceParallelRegion`` on for its own forward (the encoder and
the decoder decide on their own lengths), and the TP layers read it: no layer takes a ``sequence_parallel``
argument. The encoder output is therefore full and replicated, which is what the decoder's cross-attention k/v
(column-parallel) consume: they pass the explicit ``sequence_parallel=False`` override.

Hidden states, attentions and cross-attentions are recorded by ``transformers``' own hooks on each stack
(``_can_record_outputs``, as ``transformers``' T5), gathered over TP / SP (``common/stack/outputs.py``); the
divisibility checks are the components' rules (attention: ``num_heads``; feed-forward: ``d_ff``).

T5 specifics kept exactly: attention is unscaled (``scaling=1``) with a learned relative position bias computed
once per stack by block 0 (this rank's heads only) and reused by every block; RMS norms without bias; ReLU or
gated-GELU feed-forward; ``lm_head`` tied to ``shared`` with the ``d_model**-0.5`` rescale when
``config.scale_decoder_outputs`` (original T5), or a separate head read from the checkpoint (Flan-T5).

Shapes: b batch, s sequence, d d_model, n heads (n/tp per rank), d_kv head dim, V vocabulary.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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
from transformers.utils.generic import ModelOutput, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from ...config import ParallelConfig
from ...parallel_layers.context_parallel import build_context_parallel_mask
from ...parallel_layers.context_parallel.cross import gather_encoder_mask, gather_encoder_states
from ...parallel_layers.layers import Dropout, Embedding, Linear
from ...parallel_layers.sharding import VocabSplit
from ..common import (
    DenseActDense,
    DenseGatedActDense,
    RMSNorm,
    enter_sequence_parallel,
    leave_sequence_parallel,
    use_sequence_parallel,
)
from ..common.attention.cache_names import MASK_CACHE_KEYWORD, cache_field, output_cache
from ..common.loss.lm_loss import head_loss_and_logits
from ..common.rules.capabilities import Capabilities
from ..common.rules.parallel_rules import check_rules
from ..common.stack.context_parallel import context_parallel_loss, context_parallel_loss_items
from ..common.stack.outputs import capture_parallel_outputs
from ..modeling_utils import OsloPreTrainedModel
from .configuration_t5 import T5Config
from .layers_t5 import T5Attention, T5Block, T5LayerCrossAttention, T5LayerSelfAttention
from .parallel_plan import T5_PLAN
from .pipeline_t5 import T5PipelineAdapter


class T5PreTrainedModel(OsloPreTrainedModel):
    config_class = T5Config
    config: T5Config
    base_model_prefix = "transformer"
    parallel_plan = T5_PLAN
    supports_gradient_checkpointing = True
    _no_split_modules = ["T5Block"]
    _keep_in_fp32_modules = ["wo"]  # fp16 overflow in the feed-forward output, as transformers
    _supports_flash_attn = False
    _supports_sdpa = True
    _supports_flex_attn = True
    _keys_to_ignore_on_load_unexpected = ["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"]

    _can_record_outputs = {  # transformers' own recorders (common/stack/outputs.py gathers them over TP / SP)
        "hidden_states": OutputRecorder(T5Block, index=0),
        "attentions": OutputRecorder(T5LayerSelfAttention, index=-1),
        "cross_attentions": OutputRecorder(T5LayerCrossAttention, index=-1),
    }
    #: the components whose divisibility rules ``validate_parallel_config`` checks (``common/rules/parallel_rules.py``)
    parallel_components = (T5Attention, DenseActDense, DenseGatedActDense)

    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        rules = [rule for component in cls.parallel_components for rule in component.parallel_rules(config)]
        check_rules(dict.fromkeys(rules), config, parallel)
        if parallel.context_parallel_size > 1 and parallel.pipeline_parallel_size > 1:
            raise NotImplementedError("T5 under context parallelism with pipeline_parallel_size > 1 is not "
                                      "implemented (untested); use one of them")
        if parallel.context_parallel_size > 1 and parallel.context_parallel_mode == "hybrid":
            raise NotImplementedError("T5 under context_parallel_mode='hybrid' is not implemented: its relative "
                                      "position bias runs the gathered-keys core (ring or all_to_all layouts)")

    def tie_parallel_weights(self) -> None:
        """The stacks' ``embed_tokens`` always share ``shared``; ``lm_head`` does too unless the checkpoint
        carried a different one (``_lm_head_tied``), as ``transformers`` decides when loading. A pipeline stage
        may lack any of these modules (``None``, see ``pipeline_t5.py``); a tied head without ``shared`` on its
        stage is a copy that the pipeline engine keeps equal."""
        inner = getattr(self, "transformer", None)  # the T5Model / T5EncoderModel inside a head model
        if isinstance(inner, T5PreTrainedModel):
            inner.tie_parallel_weights()
        shared = getattr(self, "shared", None)
        if shared is None:
            return
        for stack in (getattr(self, "encoder", None), getattr(self, "decoder", None)):
            if stack is not None and stack.embed_tokens is not None:
                stack.embed_tokens.weight = shared.weight
        if getattr(self, "lm_head", None) is not None and getattr(self, "_lm_head_tied", True):
            self.lm_head.weight = shared.weight

    def set_input_embeddings(self, new_embeddings) -> None:
        """``shared`` and both stacks' ``embed_tokens`` are one module, as in ``transformers``."""
        inner = getattr(self, "transformer", None)  # a head model's T5Model / T5EncoderModel
        if isinstance(inner, T5PreTrainedModel):
            return inner.set_input_embeddings(new_embeddings)
        self.shared = new_embeddings
        for stack in (getattr(self, "encoder", None), getattr(self, "decoder", None)):
            if stack is not None:
                stack.set_input_embeddings(new_embeddings)

    def _tied_keys_to_skip(self) -> set[str]:
        """Skip on save the tied keys (``embed_tokens``, and ``lm_head`` while it is tied); an untied Flan-T5 head
        is saved. Decided by the flag, not by tensor identity: a pipeline stage's head may be a tied copy."""
        return {target for target in (getattr(self, "all_tied_weights_keys", None) or {})
                if target != "lm_head.weight" or getattr(self, "_lm_head_tied", True)}

    def run_stacks(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                   past_key_values, inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs):
        """Encoder (unless ``encoder_outputs`` are given), then the decoder over its output: both output objects.
        ``cache``: ``transformers``' new name of ``past_key_values`` (what ``generate`` passes in this version)."""
        kwargs.pop("return_dict", None)
        cache = kwargs.pop("cache", None)
        past_key_values = cache if past_key_values is None else past_key_values
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, return_dict=True, **kwargs)
        encoder_outputs = _as_encoder_output(encoder_outputs)
        context = self.parallel_context
        if context.cp_size > 1 and decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError("T5 under context parallelism needs decoder_input_ids (shifted on the full sequence "
                             "before the split: a chunk cannot shift its own labels)")
        # under cp every decoder chunk's cross-attention reads the whole encoder output (context_parallel/cross.py)
        decoder_outputs = self.decoder(input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
                                       inputs_embeds=decoder_inputs_embeds, past_key_values=past_key_values,
                                       encoder_hidden_states=gather_encoder_states(encoder_outputs.last_hidden_state,
                                                                                   context),
                                       encoder_attention_mask=gather_encoder_mask(attention_mask, context),
                                       use_cache=use_cache, return_dict=True, **kwargs)
        return encoder_outputs, decoder_outputs

    def _shift_right(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Decoder inputs from labels: prepend ``decoder_start_token_id``, drop the last token, -100 -> pad."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError("T5 needs config.decoder_start_token_id and config.pad_token_id to shift labels")
        shifted = input_ids.new_zeros(input_ids.shape)
        shifted[..., 1:] = input_ids[..., :-1].clone()
        shifted[..., 0] = start
        return shifted.masked_fill_(shifted == -100, pad)


@dataclass
class T5StackInputs:
    """What each block of one stack forward reads: the self-attention mask (causal in the decoder), the
    cross-attention mask, the cache, whether this stack runs sequence-parallel, and its full length."""

    mask: Any
    encoder_mask: Any
    past_key_values: Any
    sequence_parallel: bool
    seq_len: int


class T5Stack(T5PreTrainedModel):
    """Embeddings, ``num_layers`` blocks, final norm and dropout (encoder, or decoder with cross-attention and a
    cache). ``last_hidden_state``: ``[b, s, d]``. Built inside a parent model, never on its own.

    The forward is four phases that the pipeline stages (``pipeline_t5.py``) call too, so there is no second
    forward: ``stack_inputs`` (masks, cache, the sequence-parallel decision), then ``run_stack`` with the
    sequence-parallel region of the model's context switched on for exactly that call: ``embed`` (tokens, the
    scatter to ``[b, s/tp, d]``, the input dropout), ``run_blocks`` (block 0 computes the position biases, the
    others reuse them), ``finish`` (final norm, dropout, the gather back to ``[b, s, d]``)."""

    block_class = T5Block  # Switch Transformers' stack swaps in its block

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.embed_tokens = Embedding(config.vocab_size, config.d_model)
        self.is_decoder = config.is_decoder
        self.block = nn.ModuleList([self.block_class(config, has_relative_attention_bias=i == 0, layer_idx=i)
                                    for i in range(config.num_layers)])
        self.final_layer_norm = RMSNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = Dropout(config.dropout_rate)
        self.gradient_checkpointing = False
        self.post_init()

    def set_input_embeddings(self, new_embeddings):
        self.embed_tokens = new_embeddings

    # ------------------------------------------------------------------ phases
    def stack_inputs(self, shape_like, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                     past_key_values=None, *, sequence_parallel: bool | None = None) -> T5StackInputs:
        """``shape_like``: ``[b, s, d]`` (the masks read only its batch, length, dtype and device: a pipeline stage
        passes a zero-size expanded view). ``sequence_parallel``: the stage's decision; else this call's. Under
        context parallelism the self-attention mask is a ``ContextParallelMask`` (causal in the decoder; one
        all-gather of the padding mask) and ``encoder_hidden_states`` / ``encoder_attention_mask`` are the gathered
        whole encoder's."""
        if self.parallel_context.cp_size > 1:
            if past_key_values is not None and past_key_values.get_seq_length() > 0:
                raise NotImplementedError("a key/value cache (generation) under context parallelism is not "
                                          "implemented")
            mask = build_context_parallel_mask(self.parallel_context, attention_mask, shape_like,
                                               causal=self.is_decoder)
        elif self.is_decoder:
            self_cache = (past_key_values.self_attention_cache if isinstance(past_key_values, EncoderDecoderCache)
                          else past_key_values)
            mask = create_causal_mask(config=self.config, inputs_embeds=shape_like, attention_mask=attention_mask,
                                      **{MASK_CACHE_KEYWORD: self_cache})
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=shape_like,
                                             attention_mask=attention_mask)
        encoder_mask = None
        if self.is_decoder and encoder_hidden_states is not None:
            encoder_mask = create_bidirectional_mask(config=self.config, inputs_embeds=shape_like,
                                                     attention_mask=encoder_attention_mask,
                                                     encoder_hidden_states=encoder_hidden_states)
        seq_len = shape_like.shape[1]
        if sequence_parallel is None:
            sequence_parallel = use_sequence_parallel(self, seq_len)
        return T5StackInputs(mask, encoder_mask, past_key_values, sequence_parallel, seq_len)

    def run_stack(self, x, inputs: T5StackInputs, *, blocks=None, first: bool = True, last: bool = True,
                  position_bias=None, encoder_hidden_states=None, inputs_embeds=None, **block_kwargs):
        """``first``: ``x`` is ``input_ids [b, s]`` (or ``None`` with ``inputs_embeds``), else hidden states
        ``[b, s(/tp), d]`` and the stack's ``position_bias`` so far. Returns ``(hidden, position_bias)``, hidden
        ``[b, s, d]`` when ``last``. The sequence-parallel region is on for exactly this call."""
        region = self.parallel_context.sequence_parallel_region
        previous = region.enter(inputs.sequence_parallel)
        try:
            hidden = self.embed(inputs, x, inputs_embeds) if first else x
            hidden, position_bias = self.run_blocks(hidden, inputs, blocks, position_bias, encoder_hidden_states,
                                                    **block_kwargs)
            if last:
                hidden = self.finish(hidden, inputs)
        finally:
            region.leave(previous)
        return hidden, position_bias

    def embed(self, inputs: T5StackInputs, input_ids=None, inputs_embeds=None) -> torch.Tensor:
        """Token embeddings (vocab-parallel: all-reduce over TP; a pipeline stage passes ``inputs_embeds`` from
        ``shared``), the scatter to ``[b, s/tp, d]`` under sequence parallelism, the input dropout."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden = enter_sequence_parallel(inputs_embeds, self.parallel_context) if inputs.sequence_parallel \
            else inputs_embeds
        return self.dropout(hidden)

    def run_blocks(self, hidden, inputs: T5StackInputs, blocks=None, position_bias=None, encoder_hidden_states=None,
                   **block_kwargs):
        """``blocks`` (default: all) in order; block 0 computes the self-attention position bias (passed on as
        ``position_bias``), the first block run computes the cross-attention one (zeros, no parameters)."""
        encoder_decoder_position_bias = None
        for block in self.block if blocks is None else blocks:
            hidden, position_bias, encoder_decoder_position_bias = block(
                hidden, inputs.mask, position_bias, encoder_hidden_states, inputs.encoder_mask,
                encoder_decoder_position_bias, past_key_values=inputs.past_key_values, **block_kwargs)
        return hidden, position_bias

    def finish(self, hidden, inputs: T5StackInputs) -> torch.Tensor:
        """Final norm and dropout, then ``[b, s/tp, d] -> [b, s, d]`` under sequence parallelism."""
        hidden = self.dropout(self.final_layer_norm(hidden))
        return leave_sequence_parallel(hidden, self.parallel_context) if inputs.sequence_parallel else hidden

    # ------------------------------------------------------------------ forward
    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                inputs_embeds=None, past_key_values=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, cache=None, **kwargs):
        """``output_hidden_states`` / ``output_attentions`` (with cross-attentions) are recorded by
        ``transformers``' hooks (``_can_record_outputs``), gathered over TP heads / SP chunks. ``cache``:
        ``transformers``' new name of ``past_key_values``."""
        past_key_values = cache if past_key_values is None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if use_cache and not self.is_decoder:
            raise ValueError(f"`use_cache` can only be set to `True` if {type(self).__name__} is used as a decoder")
        if self.is_decoder:
            use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
            if use_cache and past_key_values is None:
                past_key_values = DynamicCache(config=self.config)
                if self.config.is_encoder_decoder:
                    past_key_values = EncoderDecoderCache(past_key_values, DynamicCache(config=self.config))
        else:
            past_key_values = None
        like = inputs_embeds if inputs_embeds is not None else input_ids
        dtype = like.dtype if like.is_floating_point() else self.embed_tokens.weight.dtype
        shape_like = torch.zeros((), dtype=dtype, device=like.device).expand(*like.shape[:2], self.config.d_model)
        inputs = self.stack_inputs(shape_like, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                   past_key_values)
        hidden, _ = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds,
                                   encoder_hidden_states=encoder_hidden_states, **kwargs)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden, **cache_field(past_key_values))


def _stack_config(config, *, is_decoder: bool):
    stack_config = copy.deepcopy(config)
    stack_config.is_decoder = is_decoder
    if is_decoder:
        stack_config.num_layers = config.num_decoder_layers
    else:
        stack_config.use_cache = False
    return stack_config


def _as_encoder_output(encoder_outputs) -> BaseModelOutput:
    """A user's ``encoder_outputs`` tuple (``return_dict=False``) as the output object, as ``transformers``."""
    if isinstance(encoder_outputs, ModelOutput):  # also the stack's BaseModelOutputWithPastAndCrossAttentions
        return encoder_outputs
    return BaseModelOutput(last_hidden_state=encoder_outputs[0],
                           hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                           attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None)


def _seq2seq_outputs(encoder_outputs, decoder_outputs) -> dict:
    """The fields of ``Seq2Seq*Output`` besides the head's own, from both stacks' outputs."""
    return dict(**cache_field(output_cache(decoder_outputs)),
                decoder_hidden_states=decoder_outputs.hidden_states, decoder_attentions=decoder_outputs.attentions,
                cross_attentions=decoder_outputs.cross_attentions,
                encoder_last_hidden_state=encoder_outputs.last_hidden_state,
                encoder_hidden_states=encoder_outputs.hidden_states, encoder_attentions=encoder_outputs.attentions)


class T5Model(T5PreTrainedModel):
    """Encoder-decoder without a head. ``last_hidden_state``: the decoder's ``[b, s_dec, d]``."""

    hf_twin = transformers.T5Model
    stack_class = T5Stack
    capabilities = Capabilities(context_parallel=True)
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                          "decoder.embed_tokens.weight": "shared.weight"}

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.shared = Embedding(config.vocab_size, config.d_model)
        self.encoder = self.stack_class(_stack_config(config, is_decoder=False), parallel_context=self.parallel_context)
        self.decoder = self.stack_class(_stack_config(config, is_decoder=True), parallel_context=self.parallel_context)
        self.post_init()
        if not submodule:  # inside a head model, the head model applies the plan once
            self.finish_init()

    def get_input_embeddings(self):
        return self.shared

    def get_encoder(self):
        return self.encoder

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, inputs_embeds=None, decoder_inputs_embeds=None,
                use_cache=None, **kwargs):
        encoder_outputs, decoder_outputs = self.run_stacks(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, past_key_values,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs)
        return Seq2SeqModelOutput(last_hidden_state=decoder_outputs.last_hidden_state,
                                  **_seq2seq_outputs(encoder_outputs, decoder_outputs))


class T5ForConditionalGeneration(T5PreTrainedModel, GenerationMixin):
    """T5 with the vocab-parallel LM head. The loss runs on vocab-split logits; ``logits`` are gathered to
    ``[b, s_dec, V]`` unless ``gather_logits=False`` (then ``[b, s_dec, V_padded/tp]``)."""

    hf_twin = transformers.T5ForConditionalGeneration
    stack_class = T5Stack
    pipeline_adapter = T5PipelineAdapter  # pipeline_parallel_size > 1: stages, see pipeline_t5.py
    capabilities = Capabilities(context_parallel=True)
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight",
                          "decoder.embed_tokens.weight": "shared.weight",
                          "lm_head.weight": "shared.weight"}

    def __init__(self, config, *, parallel_context=None):
        super().__init__(config, parallel_context=parallel_context)
        self.model_dim = config.d_model
        self._lm_head_tied = True
        self.shared = Embedding(config.vocab_size, config.d_model)
        self.encoder = self.stack_class(_stack_config(config, is_decoder=False), parallel_context=self.parallel_context)
        self.decoder = self.stack_class(_stack_config(config, is_decoder=True), parallel_context=self.parallel_context)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()
        self.finish_init()

    def get_input_embeddings(self):
        return self.shared

    def get_output_embeddings(self):
        return self.lm_head

    def get_encoder(self):
        return self.encoder

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        """As ``transformers``: a checkpoint whose ``lm_head.weight`` differs from ``shared.weight`` (Flan-T5,
        T5 v1.1) gets its own head. Each rank compares only its vocabulary slice; the verdict is all-reduced."""
        if self._lm_head_tied and self._checkpoint_head_differs(reader):
            if self.lm_head is not None and self.shared is not None:  # else a pipeline stage's head is its own
                self.lm_head.weight = nn.Parameter(torch.empty_like(self.shared.weight))
            self._lm_head_tied = False
        return super().load_from_reader(reader, progress=progress, **options)

    def _checkpoint_head_differs(self, reader) -> bool:
        """Each rank compares its vocabulary slice; the verdict is all-reduced over tensor parallelism, and over
        pipeline parallelism too: every stage, with or without the head, must agree on the tied groups."""
        keys = set(reader.keys())
        if "lm_head.weight" not in keys or "shared.weight" not in keys:
            return False
        context = self.parallel_context
        spec = VocabSplit(0, reader.shape("shared.weight")[0])  # lm_head's and shared's vocab split
        head, shared = (spec.read_shard(tuple(reader.shape(key)), lambda index, key=key: reader.read(key, index),
                                        context.tp_rank, context.tp_size)
                        for key in ("lm_head.weight", "shared.weight"))
        differs = torch.tensor([0 if torch.equal(head, shared) else 1], device=context.device)
        for group in (context.tp_group, context.pp_group if context.pp_size > 1 else None):
            if group is not None:
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
        return bool(differs.item())

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, past_key_values=None, inputs_embeds=None, decoder_inputs_embeds=None,
                labels=None, use_cache=None, gather_logits: bool = True, num_items_in_batch=None,
                skip_logits: bool = False, **kwargs):
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            if self.parallel_context.cp_size > 1:
                raise ValueError("T5 under context parallelism needs decoder_input_ids with labels (shifted on the "
                                 "full sequence before the split: a chunk cannot shift its own labels)")
            decoder_input_ids = self._shift_right(labels)
        encoder_outputs, decoder_outputs = self.run_stacks(
            input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs, past_key_values,
            inputs_embeds, decoder_inputs_embeds, use_cache, **kwargs)
        sequence_output = decoder_outputs.last_hidden_state
        if self.config.scale_decoder_outputs:  # original T5 (tied head) rescales before the projection
            sequence_output = sequence_output * (self.model_dim ** -0.5)
        # logits [b, s_dec, V] ([b, s_dec, V_padded/tp] with gather_logits=False, padding columns -inf; None with
        # skip_logits: the loss then runs fused and chunked, see common/loss/lm_loss.py)
        # under cp the mean over the whole target's labelled tokens (count and sum over cp)
        if labels is not None:
            num_items_in_batch = context_parallel_loss_items(self, labels, num_items_in_batch, causal=False)
        loss, logits = head_loss_and_logits(self.lm_head, sequence_output, labels, causal=False,
                                            skip_logits=skip_logits, fused=self.parallel_context.config.fused_ops,
                                            gather_logits=gather_logits, num_items_in_batch=num_items_in_batch)
        loss = context_parallel_loss(self, loss)
        return self.lm_output(loss, logits, encoder_outputs, decoder_outputs, labels)

    def lm_output(self, loss, logits, encoder_outputs, decoder_outputs, labels) -> ModelOutput:
        """The returned output from the head's loss and logits and both stacks' outputs (the hook Switch
        Transformers extends with its router losses)."""
        return Seq2SeqLMOutput(loss=loss, logits=logits, **_seq2seq_outputs(encoder_outputs, decoder_outputs))

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)


class T5EncoderModel(T5PreTrainedModel):
    """The encoder alone. ``last_hidden_state``: ``[b, s, d]``."""

    hf_twin = transformers.T5EncoderModel
    stack_class = T5Stack
    _tied_weights_keys = {"encoder.embed_tokens.weight": "shared.weight"}
    _keys_to_ignore_on_load_unexpected = ["decoder"]

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        super().__init__(config, parallel_context=parallel_context)
        self.shared = Embedding(config.vocab_size, config.d_model)
        encoder_config = _stack_config(config, is_decoder=False)
        encoder_config.is_encoder_decoder = False
        self.encoder = self.stack_class(encoder_config, parallel_context=self.parallel_context)
        self.post_init()
        if not submodule:  # inside a head model, the head model applies the plan once
            self.finish_init()

    def get_input_embeddings(self):
        return self.shared

    def get_encoder(self):
        return self.encoder

    @can_return_tuple
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, **kwargs):
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
