"""Context parallelism for image-text models: the merged (text + image tokens) sequence split after the merge.

    cfg = om.ParallelConfig(context_parallel_size=2, data_parallel_size=2, zero_stage=3)
    model = om.AutoModelForImageTextToText.from_pretrained(path, parallel=cfg)
    batch = om.image_text.context_parallel_splitter(model.parallel_context)(collated)  # labels split, rest whole
    loss = model(**batch).loss        # this rank's share of the global batch's loss

Every cp rank of a replica is given the replica's whole rows: ``input_ids [b, S]``, ``attention_mask``, the pixel
values and image grids, and its chunk(s) of the targets (:func:`context_parallel_splitter`: ``labels`` and
``shift_labels``, shifted on the whole sequence first, split like any context-parallel batch). The forward runs as
in ``transformers`` up to the language model: the vision tower and projector on every image of the rows (replicated
over cp), the features merged at the image tokens, Qwen-VL's M-RoPE positions ``[3, b, S]`` computed over the whole
sequence from the grids. A forward pre-hook on the language model then keeps this rank's chunk(s) of what it is
given (``ParallelConfig.context_parallel_mode``: ring, chunks ``r`` and ``2cp-1-r`` of ``2cp``; all-to-all, chunk
``r``): ``inputs_embeds [b, S, h] -> [b, S/cp, h]``, the position ids along their last axis (``[3, b, S] -> [3, b,
S/cp]``; without them the global positions of the chunk), and hands the layers the ``ContextParallelMask`` of the
batch through the generic path's attention function (``generic/context_parallel.py``: ring or all-to-all attention
over the cp group, causal on the global token order, padding from the whole ``attention_mask``). An image whose
tokens cross a chunk boundary gives the same numbers: its features were merged into the whole sequence before the
split, and the chunk's attention sees every earlier token of the sequence through the cp group.

The logits are the chunk's ``[b, S/cp, V]``; ``transformers``' loss reads ``shift_labels`` (the chunk's targets) over
``num_items_in_batch``, so each rank returns its chunk's share and the gradient average over dp x cp sums them -
also the vision tower's, which each cp rank reaches through its chunk's image tokens only.

Collectives per forward: the mask's all-gather of the padding over cp, the attention's (ring: ``cp - 1`` key/value
exchanges per layer; all-to-all: two per layer). Refused at load with the reason (before the check's collectives): a
language model given precomputed masks (Gemma 3's bidirectional attention inside each image's tokens, which the
context-parallel mask cannot express), one whose layers do not attend through the interface, packed rows. Qwen3-VL's
deepstack features (added at the visual tokens inside its first layers) follow the chunk: the chunk's visual-token
mask and those tokens' features.
"""
from __future__ import annotations

import torch

from ..generic.context_parallel import ATTENTION_NAME, KEYWORD, chunk_inputs, register
from . import vision


def context_parallel_splitter(parallel_context):
    """The batch transform of an image-text model under context parallelism: ``labels`` and ``shift_labels`` (the
    labels shifted on the whole sequence) split into this cp rank's chunk(s); ``input_ids``, ``attention_mask``,
    pixel values, grids and token types whole (the merge needs every image's tokens). A
    ``ContextParallelSplitter``: ``training.prepare`` leaves a loader whose collate function is (or chains) one
    alone."""
    from ..data.collators.context_parallel import ContextParallelSplitter

    return ContextParallelSplitter(parallel_context, shift_labels=True, keys=("labels", "shift_labels"))


def _chunk(context, kwargs: dict) -> dict:
    """The language model's keyword arguments for this rank's chunk(s) (module docstring)."""
    from ..parallel_layers.context_parallel.chunking import token_index

    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        raise NotImplementedError("context parallelism on an image-text model splits the merged inputs_embeds its "
                                  "language model is given; it was called with token ids")
    mask = kwargs.get("attention_mask")
    if isinstance(mask, dict) or (torch.is_tensor(mask) and mask.dim() != 2):
        raise NotImplementedError("context parallelism on an image-text model needs a [batch, seq] padding mask for "
                                  "its language model; this model hands it precomputed attention masks (Gemma 3's "
                                  "bidirectional attention inside each image's tokens), which the context-parallel "
                                  "mask (causal on the global order, padding, sliding window) cannot express")
    seq = embeds.shape[1]
    mode, cp = context.config.context_parallel_mode, context.cp_size
    from ..parallel_layers.context_parallel.chunking import check_sequence_length

    check_sequence_length(seq, cp, mode)
    index = token_index(seq // cp, context.cp_rank, cp, mode, device=embeds.device)
    positions = kwargs.get("position_ids")
    if torch.is_tensor(positions) and positions.dim() == 2 and not torch.equal(
            positions, torch.arange(seq, device=positions.device).expand_as(positions)):
        raise NotImplementedError("context parallelism on an image-text model takes one sample per row: packed rows "
                                  "(position_ids restarting per sample) are not implemented")
    chunked = {**kwargs, "inputs_embeds": embeds[:, index], "position_ids": None,
               "attention_mask": None if mask is None else mask[:, index]}
    visual = kwargs.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's deepstack features, added at the visual tokens inside the first layers
        chunked.update(_deepstack_chunk(visual, kwargs.get("deepstack_visual_embeds"), index))
    chunked = chunk_inputs(context, chunked, chunked["inputs_embeds"])
    if positions is not None:  # [b, S] or M-RoPE [3 (or 4), b, S]: the chunk's along the sequence axis
        chunked["position_ids"] = positions[..., index]
    return chunked


def _deepstack_chunk(visual: torch.Tensor, embeds, index: torch.Tensor) -> dict:
    """Qwen3-VL's deepstack inputs for the chunk ``index``: ``visual_pos_masks [b, S] -> [b, S/cp]`` and each layer's
    features ``[visual tokens, h]`` (row-major over ``[b, S]``) -> those of the chunk's visual tokens, in the chunk's
    row-major order (the order ``hidden_states[mask]`` enumerates them in)."""
    order = (visual.flatten().long().cumsum(0) - 1).view(visual.shape)  # each visual token's row in the features
    mask = visual[:, index]
    picked = order[:, index][mask]
    return {"visual_pos_masks": mask, "deepstack_visual_embeds": [layer[picked] for layer in embeds or ()]}


def _hook(context):
    def hook(module, args, kwargs):
        if args:
            raise NotImplementedError("context parallelism on an image-text model: its language model was called "
                                      "with positional arguments; expected keyword arguments (inputs_embeds=...)")
        return args, _chunk(context, kwargs)

    return hook


def install(model, context) -> None:
    """Switch the language model to the context-parallel attention, add the chunking pre-hook on it, and check with
    one text-only forward (whole dummy rows, every cp rank) that each decoder layer attends through it."""
    decoder = vision.language_model(model)
    register()
    sub = next((name for name in getattr(model.config, "sub_configs", {}) if
                getattr(model.config, name, None) is decoder.config), None)
    if sub is None:
        raise NotImplementedError(f"{type(model).__name__}: its language model's config is not one of its sub-configs; "
                                  f"the context-parallel attention could not be set on the language model only")
    model.set_attn_implementation({sub: ATTENTION_NAME})
    handle = decoder.register_forward_pre_hook(_hook(context), with_kwargs=True)
    seen = []
    probe = decoder.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs[KEYWORD]),
                                              with_kwargs=True)
    try:
        seq = 4 * context.cp_size
        ids = torch.arange(3, 3 + seq, device=context.device).remainder(decoder.config.vocab_size - 3)[None] + 3
        was_training = model.training
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        model.train(was_training)
    except BaseException:
        handle.remove()
        raise
    finally:
        probe.remove()
    layers = len(decoder.layers) if hasattr(decoder, "layers") else None
    if not seen or layers is None or seen[0].calls < layers:
        handle.remove()
        raise NotImplementedError(
            f"context_parallel_size={context.cp_size}: {seen[0].calls if seen else 0} of the {layers} layers of "
            f"{type(model).__name__}'s language model attend through transformers' attention interface; the others "
            f"would see only this rank's chunk of the sequence")


class ContextParallelCollate:
    """``collate`` (e.g. ``om.data.ImageTextCollator``), then every ``[b, S]`` entry right-padded to a length the cp
    layout splits (``2 cp`` for ring, ``cp`` for all-to-all; ``input_ids`` with ``pad_token_id``, labels with
    ``-100``, masks and token types with 0), then :func:`context_parallel_splitter` (``self.splitter``, which
    ``training.prepare`` recognises: it does not split such a loader again). Build the loader with
    ``split_context=False``. No collective."""

    def __init__(self, collate, parallel_context, pad_token_id: int):
        from ..parallel_layers.context_parallel.chunking import num_chunks

        self.collate, self.pad_token_id = collate, pad_token_id
        self.splitter = context_parallel_splitter(parallel_context)
        self.multiple = num_chunks(self.splitter.cp_size, self.splitter.mode)

    def __call__(self, samples) -> dict:
        batch = self.collate(samples)
        if "cu_seqlens" in batch or "position_ids" in batch:
            raise NotImplementedError("context parallelism on an image-text model takes one sample per row: packed "
                                      "rows are not implemented")
        seq = batch["input_ids"].shape[1]
        extra = -seq % self.multiple
        fill = {"input_ids": self.pad_token_id, "labels": -100}
        if extra:
            batch = {key: torch.nn.functional.pad(value, (0, extra), value=fill.get(key, 0))
                     if torch.is_tensor(value) and value.dim() == 2 and value.shape[1] == seq
                     and key in ("input_ids", "attention_mask", "labels", "token_type_ids", "mm_token_type_ids")
                     else value for key, value in batch.items()}
        return self.splitter(batch)
