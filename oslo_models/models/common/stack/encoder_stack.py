"""The encoders' counterpart of ``TransformerStack`` (``stack.py``): the base model of BERT and the families over
its layers (RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA, ALBERT, DistilBERT), built from its ``StackSpec``'s parts
(``stack_parts.py``: ``Embeddings("embeddings", ...)``, ``Container("encoder", ...)``, ``Layers("encoder.layer")``,
``Pooler("pooler", ...)``) by ``TransformerStack.__init__``; ``add_pooling_layer`` (``transformers``' argument,
which the encoder heads pass: ``uses_pooler``) decides whether the ``Pooler`` part is built.

What differs from the decoders' stack, and where:

- the embeddings module (sum of the tables, LayerNorm, dropout) runs whole on every rank, outside the
  sequence-parallel region, before the scatter ``[b, s, h] -> [b, s/tp, h]`` (``_embed_phase``); a family that
  projects the embeddings to the hidden width afterwards (ELECTRA's ``embeddings_project``, ALBERT's
  ``embedding_hidden_mapping_in``) overrides ``embedding_output`` and names those modules in ``embedding_extras``
  (a pipeline's first stage keeps them);
- the masks are bidirectional (padding only; per document for packed rows), causal with a key/value cache when
  ``config.is_decoder`` (``layer_masks``);
- the embeddings' class may derive the position ids from ``input_ids`` (RoBERTa's ``derives_positions``);
- the pooler (``pool``, ALBERT overrides it) reads the gathered ``[b, s, h]``; the cross-attention of a decoder
  with ``config.add_cross_attention`` gets its padding mask once per forward (``cross_attention_mask``).

Collectives: those of the layers (the plan's), plus the sequence-parallel scatter after the embeddings and the
gather after the last layer. Shapes: b batch, s sequence, h hidden, e embedding width.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from ..attention.cache_names import cache_field
from ..attention.causal_masks import FULL, causal_masks
from ..attention.cross_attention import self_attention_cache
from ..attention.encoder_masks import document_bidirectional_masks, encoder_documents
from .outputs import capture_parallel_outputs
from .sequence_parallel import enter_sequence_parallel
from .stack import TransformerStack


class PoolingArgument:
    """Mixin of an encoder's base model (before ``TransformerStack``): takes ``transformers``' ``add_pooling_layer``
    (the encoder heads pass it: ``uses_pooler``), which decides whether the spec's ``Pooler`` / ``Pooling`` parts
    are built; a family without a pooler (ELECTRA, DistilBERT, DeBERTa-v2, ModernBERT) has no such part."""

    def __init__(self, config, add_pooling_layer: bool = True, *, parallel_context=None, submodule: bool = False):
        self.add_pooling_layer = add_pooling_layer  # a plain attribute, read by the pooling parts while building
        super().__init__(config, parallel_context=parallel_context, submodule=submodule)


class EncoderStack(PoolingArgument, TransformerStack):
    """Mixin of an encoder's base model (with its ``PreTrainedModel``): built from ``stack_spec.parts``, run by the
    shared phases with the encoder hooks above. ``last_hidden_state``: ``[b, s, h]``; ``pooler_output``: ``[b, h]``
    when the model has a pooler."""

    output_class = BaseModelOutputWithPoolingAndCrossAttentions

    @classmethod
    def embeddings_module(cls) -> type:
        """The class of the embeddings (the spec's ``Embeddings`` part)."""
        return cls.stack_spec.embeddings_module

    def pooler_module(self):
        """The pooler, ``None`` when built without one (or the family has none)."""
        return self.part(self.stack_spec.pooler)

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        """``pooler_output [b, h]`` from ``[b, s, h]`` (ALBERT: its ``pooler`` linear and ``pooler_activation``)."""
        return self.pooler_module()(hidden)

    @classmethod
    def embedding_extras(cls, config) -> tuple[str, ...]:
        """Modules besides ``embeddings`` that ``embedding_output`` runs (a pipeline's first stage keeps them)."""
        return ()

    def embedding_output(self, **inputs) -> torch.Tensor:
        """The embeddings' ``[b, s, h]`` (ELECTRA, ALBERT: projected from ``embedding_size`` to the hidden width)."""
        return self.embeddings(**inputs)

    # ------------------------------------------------------------------ the stack's hooks
    @property
    def causal(self) -> bool:
        return bool(getattr(self.config, "is_decoder", False))

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """Bidirectional (padding only), or causal when ``config.is_decoder``: ``transformers``' masks. Packed
        documents (caller-given ``position_ids`` restarting per document) attend within themselves: bidirectional
        per document (``common/attention/encoder_masks.py``), causal per document
        (``common/attention/causal_masks.py``)."""
        if self.causal:  # the decoders' masks (packed documents, Flex, the cache)
            return causal_masks(self.config, shape_like, attention_mask, self_attention_cache(past_key_values),
                                position_ids, kinds={FULL})
        documents = encoder_documents(shape_like, attention_mask, position_ids)
        if documents is not None:
            return document_bidirectional_masks(self.config, shape_like, documents, {FULL})
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=shape_like, attention_mask=attention_mask)
        return {FULL: mask}

    def stack_inputs(self, shape_like, attention_mask=None, position_ids=None, past_key_values=None, **options):
        """The stack's inputs; when the embeddings derive the position ids from ``input_ids`` (RoBERTa) and none
        are given, ``position_ids`` stays ``None`` for them (under context parallelism they must be given: a chunk
        cannot count the padding before it)."""
        derived = position_ids is None and self.embeddings_module().derives_positions
        if derived and self.parallel_context.cp_size > 1:
            raise ValueError(f"{type(self).__name__} derives position ids from the whole sequence: under context "
                             "parallelism pass position_ids computed on the full sequence (split like input_ids)")
        inputs = super().stack_inputs(shape_like, attention_mask, position_ids, past_key_values, **options)
        if derived:
            inputs.position_ids = None
        return inputs

    def _embed_phase(self, input_ids, inputs, inputs_embeds, token_type_ids) -> torch.Tensor:
        """The embeddings on the full ``[b, s, h]``, replicated (outside the sequence-parallel region: their
        LayerNorm and dropout see every token on every rank), then the scatter to ``[b, s/tp, h]`` under SP."""
        past = inputs.past_key_values.get_seq_length() if inputs.past_key_values is not None else 0
        hidden = self.parallel_context.sequence_parallel_region.run(
            False, self.embedding_output, input_ids=input_ids, token_type_ids=token_type_ids,
            position_ids=inputs.position_ids, inputs_embeds=inputs_embeds, past_key_values_length=past)
        if inputs.sequence_parallel:  # [b, s, h] -> [b, s/tp, h]
            hidden = enter_sequence_parallel(hidden, self.parallel_context)
        return hidden

    # ------------------------------------------------------------------ forward
    def cross_attention_mask(self, shape_like, encoder_attention_mask, encoder_hidden_states):
        """The cross-attention's padding mask ``[b, 1, s, s_enc]`` (``None`` without ``encoder_attention_mask``, as
        ``transformers``), built once per forward for every layer."""
        if encoder_attention_mask is None or encoder_hidden_states is None:
            return None
        return create_bidirectional_mask(config=self.config, inputs_embeds=shape_like,
                                         attention_mask=encoder_attention_mask,
                                         encoder_hidden_states=encoder_hidden_states)

    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, output_attentions=None, output_hidden_states=None, past_key_values=None,
                use_cache=None, encoder_hidden_states=None, encoder_attention_mask=None, cache=None,
                **kwargs) -> BaseModelOutputWithPoolingAndCrossAttentions:
        """``encoder_hidden_states [b, s_enc, h]`` (full, the same on every TP rank): the cross-attention's input
        when ``config.add_cross_attention``; the cache is then an ``EncoderDecoderCache``. ``cache``:
        ``transformers``' new name of ``past_key_values``."""
        past_key_values = cache if past_key_values is None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        pooler = self.pooler_module()
        if self.parallel_context.cp_size > 1 and pooler is not None:
            raise NotImplementedError("the [CLS] pooler under context parallelism is not implemented (only cp rank "
                                      "0 holds the first token); build the model with add_pooling_layer=False")
        use_cache = (use_cache if use_cache is not None else getattr(self.config, "use_cache", False)) and self.causal
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
            if encoder_hidden_states is not None or getattr(self.config, "is_encoder_decoder", False):
                past_key_values = EncoderDecoderCache(past_key_values, DynamicCache(config=self.config))
        if not self.causal:
            past_key_values = None
        shape_like = self._shape_only(inputs_embeds if inputs_embeds is not None else input_ids[..., None])
        given, position_ids = position_ids, self._packed_positions(shape_like, attention_mask, position_ids, kwargs)
        if given is None and position_ids is not None:  # read from cu_seqlens / seq_idx
            position_ids = position_ids + self.embeddings_module().first_position(self.config)
        inputs = self.stack_inputs(shape_like, attention_mask, position_ids, past_key_values)
        if encoder_hidden_states is not None:  # layer keywords only when there is a cross-attention input
            kwargs.update(encoder_hidden_states=encoder_hidden_states, encoder_attention_mask=self.cross_attention_mask(
                shape_like, encoder_attention_mask, encoder_hidden_states))
        hidden = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
                                **kwargs)
        pooled = self.pool(hidden) if pooler is not None else None
        fields = self.output_class.__dataclass_fields__  # DistilBERT's has no pooler, ALBERT's no cache
        outputs = dict(last_hidden_state=hidden, pooler_output=pooled,
                       **cache_field(past_key_values if use_cache else None))
        return self.output_class(**{key: value for key, value in outputs.items() if key in fields})
