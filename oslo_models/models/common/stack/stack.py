"""The stack every decoder-only (and, with its own mask hook, encoder-only) base model runs: written once, in three
phases that the model's ``forward`` and every pipeline stage both call, so there is no second forward anywhere.

- ``stack_inputs``: what every layer of one forward reads, computed once: the position ids (given; the global
  positions of this rank's chunk under context parallelism; else ``arange(s)`` after the cached length, so a cached
  decode step called without ``position_ids`` gets the right positions), the mask of each attention type, the rotary
  ``(cos, sin)`` (one pair, or one per attention type when the rotary module returns a dict), the cache, and whether
  this forward runs sequence parallelism;
- ``run_stack(x, inputs, layers, first, last)``: embeddings (``first``: token and learned position embeddings, the
  scatter to ``[b, s/tp, h]`` under sequence parallelism, the embedding dropout), the layers, and the final norm and
  the gather back to ``[b, s, h]`` (``last``). The sequence-parallel switch of the model's context is on for exactly
  this call (``parallel_layers/sequence_parallel.py``): no layer takes a ``sequence_parallel`` argument;
- ``forward``: the ``transformers`` signature around the two, with ``output_hidden_states`` /
  ``output_attentions`` recorded by ``transformers``' own hooks (``common/stack/outputs.py``).

A family's base model subclasses ``TransformerStack`` and declares a ``StackSpec``: its ``parts`` are the builders of
the base model's modules under ``transformers``' names, in ``transformers``' registration order (``stack_parts.py``:
``TokenEmbedding("embed_tokens")``, ``Layers("layers")``, ``FinalNorm("norm", build)``, ``Rotary("rotary_emb",
RotaryEmbedding)``, ...), so ``TransformerStack.__init__`` builds the model from the spec and the family writes no
``__init__``; the roles the phases read (``embed_tokens``, ``layers``, ...) are the parts' names. The parallel plan,
the divisibility checks and the class flags (``_no_split_modules``, ``_can_record_outputs``) are derived from the
spec too (``StackSpec.plan``, ``components.check_components``, ``heads.StackFamilyModel``).

Shapes: b batch, s sequence (this rank's chunk under cp), h hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast

from ....parallel_layers.plan import ParallelPlan, PositionEmbedding, TPDropout, VocabEmbedding
from ....utils.documents import PACKING_KEYS, document_ids, positions_in_documents
from ..attention.cache_names import cache_field
from ..attention.causal_masks import FULL, SLIDING, causal_masks
from .context_parallel import context_parallel_inputs, rotary_embeddings
from .outputs import capture_parallel_outputs
from .sequence_parallel import enter_sequence_parallel, leave_sequence_parallel, use_sequence_parallel
from .stack_parts import ROLES, Part


@dataclass(frozen=True)
class StackSpec:
    """Where a base model keeps each part (``transformers``' attribute names, dotted under a submodule: OPT's
    ``decoder.layers``) and what its blocks are made of.

    ``block``: the family's layer class (a ``blocks`` template subclass); ``components``: role -> component
    class(es) that can fill it (each carries ``tp_plan`` and ``parallel_rules``); ``norm``: the final norm's
    component (default: the block's ``mlp_norm`` or ``attn_norm`` class). Parts some configs lack (OPT's
    ``project_in`` when the widths agree, its final norm under post-norm) are ``None`` attributes: skipped.

    Optional parts run by the embedding and final phases: ``input_projection`` (token embeddings -> hidden, before
    the learned positions are added: OPT's ``project_in``), ``embedding_norm`` (after the embeddings, on this
    rank's tokens: Bloom's ``word_embeddings_layernorm``), ``output_projection`` (after the final norm, on the
    gathered ``[b, s, h]``: OPT's ``project_out``).

    ``parts``: the builders of the base model's modules (``stack_parts.py``), in ``transformers``' registration
    order; each fills its role's attribute name above (given here, a role's name is not given again). A spec
    without parts names the attributes directly and its base model builds them itself (T5, BART)."""

    block: type
    components: Mapping[str, Any]
    embed_tokens: str = "embed_tokens"
    position_embedding: str | None = None
    embedding_dropout: str | None = None
    layers: str = "layers"
    final_norm: str | None = "norm"
    rotary: str | None = None
    norm: type | None = None
    extra_plan: Mapping[str, Any] = field(default_factory=dict)
    #: ``token_type_ids`` are looked up in the token table and added (GPT-2, GPT-J: ``transformers``' rule)
    token_types_through_tokens: bool = False
    input_projection: str | None = None
    embedding_norm: str | None = None
    output_projection: str | None = None
    parts: tuple[Part, ...] = ()
    #: the attention kernels the family runs (``None``: its attention component's ``kernels``)
    kernels: frozenset[str] | None = None
    #: an encoder's embeddings module and pooler (``stack_parts.Embeddings`` / ``Pooler``;
    #: ``common/stack/encoder_stack.py``)
    embeddings: str | None = None
    pooler: str | None = None
    #: what ``transformers``' output hooks record besides (or instead of) the defaults, ``hidden_states`` on the
    #: ``block`` and ``attentions`` on the ``attn`` component (BERT: its self-attention and its cross-attentions)
    outputs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        for part in self.parts:  # the roles the phases read are the parts' names
            if part.role in ROLES:
                object.__setattr__(self, part.role, part.name)

    def module_names(self) -> tuple[str, ...]:
        """The attribute names the spec gives a module (its roles and its parts), in no particular order."""
        names = (*(getattr(self, role) for role in ROLES), *(part.name for part in self.parts))
        return tuple(dict.fromkeys(name for name in names if name))

    @property
    def attention_kernels(self) -> frozenset[str]:
        """``kernels``, or the attention component's: what the classes' ``_supports_<kernel>`` flags say."""
        return self.kernels if self.kernels is not None else self.components["attn"].kernels

    @property
    def embeddings_module(self) -> type | None:
        """The class of the ``Embeddings`` part (an encoder's), or ``None``."""
        return next((part.module for part in self.parts if part.role == "embeddings"), None)

    @property
    def no_split_modules(self) -> list[str]:
        """What ``_no_split_modules`` says: the encoder's embeddings class (when it has one) and the block."""
        embeddings = self.embeddings_module
        return ([embeddings.__name__] if embeddings is not None else []) + [self.block.__name__]

    @property
    def recorded_outputs(self) -> dict:
        """What ``_can_record_outputs`` says: ``hidden_states`` on the block, ``attentions`` on the ``attn``
        component, updated with ``outputs``."""
        return {"hidden_states": self.block, "attentions": self.components["attn"], **self.outputs}

    @property
    def final_norm_component(self):
        if self.norm is not None:
            return self.norm
        found = self.components.get("mlp_norm") or self.components.get("attn_norm")
        return found[0] if isinstance(found, tuple) else found

    def plan(self, prefix: str = "", **head_styles) -> ParallelPlan:
        """The base model's plan with its module names under ``prefix`` plus the heads' styles."""
        styles = {self.embed_tokens: VocabEmbedding()}
        if self.position_embedding:
            styles[self.position_embedding] = PositionEmbedding()
        if self.embedding_dropout:
            styles[self.embedding_dropout] = TPDropout()
        styles.update({f"{self.layers}.*.{pattern}": style
                       for pattern, style in self.block.tp_plan(self.components).items()})
        for norm in (self.embedding_norm, self.final_norm):  # both of the final norm's kind
            if norm:
                styles.update({f"{norm}.{p}" if p else norm: s
                               for p, s in getattr(self.final_norm_component, "tp_plan", {}).items()})
        styles.update(self.extra_plan)
        return ParallelPlan({**{(f"{prefix}.{p}" if prefix else p): s for p, s in styles.items()}, **head_styles})


@dataclass
class StackInputs:
    """What each layer of one forward reads. ``masks``: attention type -> mask (a ``ContextParallelMask`` under
    cp); ``position_embeddings``: rotary ``(cos, sin)`` ``[b, s, d]``, or attention type -> ``(cos, sin)`` when the
    rotary module returns one pair per type (Gemma 3's local and global bases), or ``None``; ``seq_len``: the full
    length of this rank's sequence (before any sequence-parallel split)."""

    position_ids: torch.Tensor
    masks: dict
    position_embeddings: Any
    past_key_values: Any
    sequence_parallel: bool
    seq_len: int

    def layer_positions(self, kind: str):
        """The rotary ``(cos, sin)`` of a layer of attention type ``kind``."""
        if isinstance(self.position_embeddings, dict):
            return self.position_embeddings[kind]
        return self.position_embeddings


class TransformerStack:
    """Mixin of a base model (with ``OsloPreTrainedModel``): built from ``stack_spec.parts`` and run by the shared
    forward. See the module docstring."""

    stack_spec: ClassVar[StackSpec]
    #: masks are causal (decoders); an encoder overrides ``layer_masks``
    causal: ClassVar[bool] = True
    #: ``transformers``' output class of the base model (GPT-2: ``BaseModelOutputWithPastAndCrossAttentions``)
    output_class: ClassVar[type] = BaseModelOutputWithPast
    #: the spec's module names (``StackSpec.module_names``) this config builds no module for (OPT's ``project_in``
    #: when the widths agree, its final norm under post-norm), fixed when the model is built (``part`` also finds
    #: ``None`` where a pipeline stage dropped a module)
    absent_parts: frozenset[str] = frozenset()

    def __init__(self, config, *, parallel_context=None, submodule: bool = False):
        """Builds ``stack_spec.parts`` in order with the family's options of ``config`` (``stack_options``, built
        once here), then ``post_init``; ``finish_init`` (the parallel plan, the weights' placement) unless the
        model is a head's ``submodule``. A spec without parts (T5, BART) builds in its own ``__init__``."""
        super().__init__(config, parallel_context=parallel_context)
        if not self.stack_spec.parts:
            return
        options = self.stack_options(config)
        for part in self.stack_spec.parts:
            owner, _, name = part.name.rpartition(".")
            setattr(self.part(owner) if owner else self, name, part.build(self, config, options))
        self.absent_parts = frozenset(name for name in self.stack_spec.module_names() if self.part(name) is None)
        self.gradient_checkpointing = False
        self.post_init()
        if not submodule:
            self.finish_init()

    def build_layer(self, config, layer_idx: int, options) -> nn.Module:
        """Layer ``layer_idx`` (the ``Layers`` part): the spec's block built from the config (a family whose block
        takes its options or other arguments overrides this)."""
        return self.stack_spec.block(config, layer_idx)

    # ------------------------------------------------------------------ hooks
    def part(self, name: str | None) -> nn.Module | None:
        """The module at the spec's (possibly dotted) attribute ``name``; ``None`` if ``name`` is ``None`` or the
        model has no such part (a ``None`` attribute: absent for this config, or dropped by a pipeline stage)."""
        module = self
        for attribute in name.split(".") if name else ():
            module = getattr(module, attribute, None)
            if module is None:
                return None
        return module if name else None

    def embed(self, input_ids, inputs_embeds, position_ids, token_type_ids=None) -> torch.Tensor:
        """``[b, s, h]`` on every TP rank: token embeddings (vocab-parallel: all-reduce over TP), projected to the
        hidden width when the spec has an ``input_projection``, plus learned position embeddings when the spec has
        them, plus token-type ids through the token table when the spec says so (GPT-2, GPT-J)."""
        spec = self.stack_spec
        if inputs_embeds is None:
            inputs_embeds = self.part(spec.embed_tokens)(input_ids)
        hidden = inputs_embeds
        projection = self.part(spec.input_projection)
        if projection is not None:
            hidden = projection(hidden)
        if spec.position_embedding:
            hidden = hidden + self.position_embeds(position_ids)
        if spec.token_types_through_tokens and token_type_ids is not None:
            hidden = hidden + self.part(spec.embed_tokens)(token_type_ids.view(-1, hidden.shape[1]))
        return hidden

    def position_embeds(self, position_ids) -> torch.Tensor:
        """The learned position embeddings ``[b, s, h]`` of ``position_ids`` (OPT offsets the rows)."""
        return self.part(self.stack_spec.position_embedding)(position_ids)

    def get_input_embeddings(self):
        return self.part(self.stack_spec.embed_tokens)

    def set_input_embeddings(self, value):
        owner, _, name = self.stack_spec.embed_tokens.rpartition(".")
        setattr(self.part(owner) if owner else self, name, value)

    def layer_masks(self, shape_like, attention_mask, past_key_values, position_ids, kinds) -> dict:
        """``{attention type: mask}`` for ``kinds`` (``transformers``' causal / sliding-window masks)."""
        return causal_masks(self.config, shape_like, attention_mask, past_key_values, position_ids, kinds=kinds)

    # ------------------------------------------------------------------ phases
    def stack_inputs(self, shape_like: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                     *, layers=None, sequence_parallel: bool | None = None) -> StackInputs:
        """``shape_like``: ``[b, s, ...]`` (only its batch, length, dtype and device are read: a pipeline stage
        passes a zero-size expanded view)."""
        layers = self._layers() if layers is None else layers
        seq_len = shape_like.shape[1]
        if attention_mask is not None and not isinstance(attention_mask, dict) and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(shape_like.shape[0], -1)
        cp_mask, position_ids = context_parallel_inputs(self, shape_like, attention_mask, position_ids,
                                                        past_key_values, causal=self.causal)
        # positions the stack numbers itself cannot mark packed documents: the masks then skip the packing check,
        # whose data-dependent branch would break a compiled graph for every plain batch
        given_positions = position_ids
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(seq_len, device=shape_like.device) + past_seen)[None]
        kinds = {getattr(layer, "attention_type", FULL) for layer in layers} or {FULL}
        if cp_mask is not None:  # one mask for every layer kind: each layer passes its own sliding window
            masks = {kind: cp_mask for kind in (FULL, SLIDING)}
        else:
            masks = self.layer_masks(shape_like, attention_mask, past_key_values, given_positions, kinds)
        rotary = self.part(self.stack_spec.rotary)
        position_embeddings = rotary_embeddings(self, rotary, shape_like, position_ids) if rotary is not None else None
        if sequence_parallel is None:
            sequence_parallel = use_sequence_parallel(self, seq_len)
        return StackInputs(position_ids, masks, position_embeddings, past_key_values, sequence_parallel, seq_len)

    def run_stack(self, x: torch.Tensor, inputs: StackInputs, *, layers=None, first: bool = True,
                  last: bool = True, inputs_embeds=None, token_type_ids=None, **layer_kwargs) -> torch.Tensor:
        """``first``: ``x`` is ``input_ids [b, s]`` (or ``None`` with ``inputs_embeds``); else hidden states
        ``[b, s(/tp), h]``. Returns hidden states, ``[b, s, h]`` when ``last``. ``layer_kwargs`` go to every layer."""
        region = self.parallel_context.sequence_parallel_region
        previous = region.enter(inputs.sequence_parallel)
        try:
            hidden = self._embed_phase(x, inputs, inputs_embeds, token_type_ids) if first else x
            for layer in self._layers() if layers is None else layers:
                kind = getattr(layer, "attention_type", FULL)
                hidden = layer(hidden, inputs.masks[kind], inputs.layer_positions(kind), inputs.past_key_values,
                               position_ids=inputs.position_ids, **layer_kwargs)
            if last:
                hidden = self._finish_phase(hidden, inputs)
        finally:
            region.leave(previous)
        return hidden

    def _embed_phase(self, input_ids, inputs: StackInputs, inputs_embeds, token_type_ids) -> torch.Tensor:
        hidden = self.embed(input_ids, inputs_embeds, inputs.position_ids, token_type_ids)
        if inputs.sequence_parallel:  # [b, s, h] -> [b, s/tp, h]
            hidden = enter_sequence_parallel(hidden, self.parallel_context)
        # after the scatter: under SP the norm sees this rank's tokens, and its style sums its gradients over TP
        for name in (self.stack_spec.embedding_norm, self.stack_spec.embedding_dropout):
            module = self.part(name)
            hidden = module(hidden) if module is not None else hidden
        return hidden

    def _finish_phase(self, hidden: torch.Tensor, inputs: StackInputs) -> torch.Tensor:
        norm = self.part(self.stack_spec.final_norm)
        if norm is not None:
            hidden = norm(hidden)
        if inputs.sequence_parallel:  # [b, s/tp, h] -> [b, s, h]
            hidden = leave_sequence_parallel(hidden, self.parallel_context)
        projection = self.part(self.stack_spec.output_projection)  # replicated, on the whole sequence
        return projection(hidden) if projection is not None else hidden

    def _layers(self) -> nn.ModuleList:
        return self.part(self.stack_spec.layers)

    # ------------------------------------------------------------------ forward
    @capture_parallel_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, token_type_ids=None, cache=None,
                **kwargs) -> BaseModelOutputWithPast:
        """``last_hidden_state [b, s, h]``; ``past_key_values`` when caching; ``hidden_states`` / ``attentions``
        when asked for (gathered over TP heads / SP chunks, as ``transformers`` returns them). ``cache``: the newer
        ``transformers`` name of ``past_key_values`` (its ``generate`` passes it), accepted as an alias."""
        if past_key_values is None:
            past_key_values = cache
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            input_ids = input_ids.view(-1, input_ids.shape[-1])
        shape_like = inputs_embeds if inputs_embeds is not None else input_ids[..., None]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        position_ids = self._packed_positions(shape_like, attention_mask, position_ids, kwargs)
        inputs = self.stack_inputs(self._shape_only(shape_like), attention_mask, position_ids, past_key_values)
        hidden = self.run_stack(input_ids, inputs, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
                                **kwargs)
        return self.output_class(last_hidden_state=hidden, **cache_field(past_key_values if use_cache else None))

    def _packed_positions(self, shape_like, attention_mask, position_ids, kwargs):
        """The batch's packing keys (``cu_seqlens`` / ``seq_idx``, consumed from ``kwargs``) read as positions that
        restart per document, which is how the masks and the rotary read documents; ``position_ids`` as given
        when there are none (``ValueError`` when both are given and disagree)."""
        packing = {key: kwargs.pop(key) for key in PACKING_KEYS if key in kwargs}
        cu_seqlens = packing.get("cu_seqlens", packing.get("cu_seq_lens_q"))
        if cu_seqlens is None and packing.get("seq_idx") is None:
            return position_ids
        if self.parallel_context.cp_size > 1:
            raise NotImplementedError("cu_seqlens / seq_idx under context parallelism: pass position_ids that "
                                      "restart per document (the context-parallel splitter splits them)")
        batch, seq = shape_like.shape[:2]
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        documents = document_ids(batch, seq, cu_seqlens=cu_seqlens, seq_idx=packing.get("seq_idx"),
                                  attention_mask=mask, device=shape_like.device)
        if documents is None:
            return position_ids
        positions = positions_in_documents(documents)
        if position_ids is not None:
            given = document_ids(batch, seq, position_ids=position_ids, attention_mask=mask, device=shape_like.device)
            if given is None or not torch.equal(given[:, 1:] != given[:, :-1], documents[:, 1:] != documents[:, :-1]):
                raise ValueError("position_ids and cu_seqlens / seq_idx mark different documents")
            return position_ids
        return positions

    def _shape_only(self, like: torch.Tensor) -> torch.Tensor:
        """A zero-storage ``[b, s, h]`` view in the model's dtype (masks and rotary read only shape/dtype/device)."""
        dtype = self.dtype if not like.is_floating_point() else like.dtype
        return torch.zeros((), dtype=dtype, device=like.device).expand(*like.shape[:2], self.config.hidden_size)
