"""Per-document attention for packed batches on the generic path: documents of a row never see each other.

``transformers`` reads packed documents from restarting ``position_ids`` only inside its mask builders and only
when no cache is passed; a decoder called for training (``use_cache`` defaults to ``True``, so the model makes a
``DynamicCache`` itself) or one that does not hand ``position_ids`` to its mask builder (XGLM, MPT) builds a plain
causal mask, and the documents of a row attend to each other, silently (measured: 6e-3 off the per-document loss
on an 8-row batch at dp 4). :func:`install` closes that through public extension points, nothing patched:

a forward pre-hook on the model reads the documents of the batch (``utils/documents.py``: ``cu_seqlens``,
``seq_idx`` or restarting ``position_ids``, padding as one document per token) and, when a row holds more than
one, builds the per-document masks with ``transformers``' own builders (``create_causal_mask``,
``create_sliding_window_causal_mask``, ``create_chunked_causal_mask``) for the model's attention implementation
(a boolean ``[b, 1, s, s]`` for SDPA, an additive one for eager, a ``BlockMask`` for FlexAttention, which builds
no ``[s, s]`` tensor) and passes them as the model's ``attention_mask``: a prepared mask every ``transformers``
decoder takes as is, one per layer type (``{"full_attention": ..., "sliding_attention": ...}``) for the models
whose layers differ. Positions restart per document when the batch gave none (``cu_seqlens`` / ``seq_idx``
alone), so learned and sinusoidal position embeddings see what the per-document run sees.

The packing keys (``PACKING_KEYS``) are consumed here: the model never receives them. Refused with the reason
(``ValueError`` / ``NotImplementedError``, never silently wrong): packing with a cache (decoding), with a prepared
4D mask, a layer type that is not attention (state-space / recurrent layers carry state across documents), a
bidirectional model, and flash attention over more than one row (``transformers``' varlen path reads one row).
Collectives: none.
"""
from __future__ import annotations

import inspect

import torch

from ..utils.documents import PACKING_KEYS, document_ids, positions_in_documents
from .context_parallel import ATTENTION_NAME as CONTEXT_PARALLEL_ATTENTION
from .install_state import generic_install, update_generic_install

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


def layer_kinds(config) -> list[str]:
    """The attention kind of each layer, as ``transformers`` decoders pick their masks: ``config.layer_types`` when
    set, else every layer sliding-window when ``config.sliding_window`` is set (Mistral, Starcoder2), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    return [SLIDING if getattr(config, "sliding_window", None) else FULL]


def _builders():
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_sliding_window_causal_mask,
    )

    return {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask, CHUNKED: create_chunked_causal_mask}


def document_masks(config, documents: torch.Tensor, dtype: torch.dtype):
    """The model's attention mask for ``documents [b, s]``: causal within each document, for every layer kind of
    ``config`` in the format of ``config._attn_implementation``; one mask, or ``{kind: mask}`` when kinds differ.
    Built by ``transformers`` from positions that restart per document (its packed-sequence rule)."""
    kinds = sorted(set(layer_kinds(config)))
    unknown = [kind for kind in kinds if kind not in (FULL, SLIDING, CHUNKED)]
    if getattr(config, "num_attention_heads", None) is None:
        unknown = unknown or ["no attention heads"]
    if unknown:
        raise NotImplementedError(
            f"packed documents through {config.model_type!r}: its layer types {unknown} are not attention (a "
            "state-space or recurrent layer carries its state across the documents of a row); run one document per "
            "row")
    if not getattr(config, "is_causal", True):
        raise NotImplementedError(f"packed documents through the bidirectional {config.model_type!r}: only causal "
                                  "decoders are supported on the generic path")
    batch, seq = documents.shape
    shape_only = torch.empty(batch, seq, 0, dtype=dtype, device=documents.device)  # read for b, s, dtype, device
    positions = positions_in_documents(documents)
    masks = {kind: _builders()[kind](config, shape_only, None, None, positions) for kind in kinds}
    if any(mask is None for mask in masks.values()):
        raise NotImplementedError(
            f"packed documents with attn_implementation={config._attn_implementation!r}: transformers built no "
            "mask for it, so the documents of a row would see each other; use 'sdpa', 'eager' or 'flex_attention'")
    return masks[kinds[0]] if len(kinds) == 1 else masks


class _Call:
    """One forward's arguments by name, whether passed by position or keyword."""

    def __init__(self, forward, args: tuple, kwargs: dict):
        params = inspect.signature(forward).parameters
        self.names = [name for name, p in params.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:len(args)]
        self.accepts = set(params) | ({"*"} if any(p.kind == p.VAR_KEYWORD for p in params.values()) else set())
        self.args, self.kwargs = list(args), kwargs

    def get(self, name):
        if name in self.names:
            return self.args[self.names.index(name)]
        return self.kwargs.get(name)

    def set(self, name, value) -> None:
        if name in self.names:
            self.args[self.names.index(name)] = value
        else:
            self.kwargs[name] = value

    def done(self):
        return tuple(self.args), self.kwargs


def _before(module, args, kwargs):
    packing = {key: kwargs.pop(key) for key in PACKING_KEYS if key in kwargs}
    call = _Call(module.forward, args, kwargs)
    ids = call.get("input_ids")
    shape_like = ids if ids is not None else call.get("inputs_embeds")
    if shape_like is None:
        return call.done()
    batch, seq = shape_like.shape[:2]
    mask, position_ids = call.get("attention_mask"), call.get("position_ids")
    if position_ids is not None and position_ids.dim() == 3:  # multimodal rotary (Qwen-VL's M-RoPE): [3 | 4, b, s]
        # transformers' 4-row form carries the text positions in row 0; the 3 rotary axes alone name no documents
        position_ids = position_ids[0] if position_ids.shape[0] == 4 else None
    cu_seqlens = packing.get("cu_seqlens", packing.get("cu_seq_lens_q"))
    if "cu_seq_lens_k" in packing and cu_seqlens is not None and \
            not torch.equal(torch.as_tensor(packing["cu_seq_lens_k"]), torch.as_tensor(cu_seqlens)):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: packed self-attention has one set of documents")
    explicit = cu_seqlens is not None or packing.get("seq_idx") is not None
    prepared = isinstance(mask, dict) or (mask is not None and getattr(mask, "dim", lambda: 4)() != 2)
    if prepared:  # the caller built the mask: it decides what attends to what
        if explicit:
            raise ValueError("packed documents (cu_seqlens / seq_idx) with a prepared attention mask: pass one")
        return call.done()
    documents = document_ids(batch, seq, position_ids=position_ids, cu_seqlens=cu_seqlens,
                             seq_idx=packing.get("seq_idx"), attention_mask=mask, device=shape_like.device)
    if documents is None:
        return call.done()
    cache = call.get("past_key_values") if call.get("past_key_values") is not None else call.get("cache")
    if cache is not None:  # decoding: generate's own positions and padding mask decide
        if explicit:
            raise ValueError("packed documents (cu_seqlens / seq_idx) with a cache (past_key_values): decode one "
                             "document per row")
        return call.done()
    config = module.config.get_text_config(decoder=True)  # an image-text model's masks are its decoder's
    if str(config._attn_implementation) == CONTEXT_PARALLEL_ATTENTION:
        return call.done()  # its mask finds the documents on the whole sequence (position ids and padding)
    if "flash" in str(config._attn_implementation):
        if batch > 1:
            raise NotImplementedError(
                "packed documents through flash attention on the generic path: transformers' varlen path reads one "
                "row; flatten the batch to one row, or use attn_implementation='sdpa' / 'flex_attention'")
        call.set("position_ids", positions_in_documents(documents))
        call.set("attention_mask", None)
        return call.done()
    call.set("attention_mask", document_masks(config, documents, module.dtype))
    if position_ids is None and "position_ids" in call.accepts:
        call.set("position_ids", positions_in_documents(documents))
    return call.done()


def per_document_inputs(model, kwargs: dict) -> dict:
    """The keyword arguments of ``model``'s forward with the packing rule above applied (what the pre-hook of
    :func:`install` passes on): for a pipeline stage, which calls the class's forward directly
    (``pipeline_stage.py``). ``kwargs`` holds no positional ``args``; the packing keys are consumed."""
    return _before(model, (), dict(kwargs))[1]


def install(model) -> None:
    """Make ``model`` (a ``transformers`` decoder on the generic path) attend per document in packed batches;
    idempotent."""
    if generic_install(model).packed_attention_hook is not None:
        return
    update_generic_install(model, packed_attention_hook=model.register_forward_pre_hook(_before, with_kwargs=True))
