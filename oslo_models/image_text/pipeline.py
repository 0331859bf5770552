"""Pipeline parallelism for image-text models: the vision side on the first stage, image batches split by rows.

    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, zero_stage=3)
    model = om.AutoModelForImageTextToText.from_pretrained(path, parallel=cfg, freeze_vision=True)
    loss = model.train_step(batch)   # input_ids, labels, attention_mask, pixel_values, image_grid_thw, ...

The model is cut like any generic causal LM (``generic/pipeline_cut.py``) at its language model's layers
(``model.language_model.layers``); the vision tower and projector (every child of the base model besides the
language model: ``StagePieces.first``) live on the first stage only, with the input embedding. Each stage runs
``transformers``' whole forward over its view of the layers (``generic/pipeline_stage.py``):

- the first stage is given the microbatch's pixel values (and ``image_sizes`` / ``pixel_attention_mask``): the
  vision tower and projector run, their features are merged at the image tokens into the embeddings exactly as in
  ``transformers``, and the stage's layers run on the merged sequence;
- every stage is given the token ids and what the decoder derives its positions and masks from: Qwen-VL's
  ``image_grid_thw`` and ``mm_token_type_ids`` (the 3-axis M-RoPE positions ``[3, mb, s]`` are computed from them on
  each stage, as the unpipelined forward computes them), Gemma 3's ``token_type_ids`` (the bidirectional attention
  inside each image's tokens); stages after the first start from the received hidden states ``[mb, s, h]``, which
  carry the merged image features on (the probe before their first layer injects them), so no vision input or
  merged embedding is sent besides them.

Microbatches are cut by rows, but several image tensors are indexed by image (``pixel_values [images, ...]``,
Qwen's flattened patches ``[patches, d]``, ``image_grid_thw [images, 3]``, ``image_sizes [images, 2]``):
``prepare_batch`` regroups each by row, padded to the most in a row (``[b, n_max, ...]``) with the row's count beside
it (``<key>_per_row [b]``), so torch's schedule splits them along the batch like any other tensor; the stage
concatenates its rows' entries back. An image belongs to a row by its tokens: one run of image tokens per image
(LLaVA, LLaVA-NeXT, Gemma 3, Qwen-VL; Idefics3 / SmolVLM hold ``pixel_values [b, images, ...]`` by row already); a
batch whose image runs do not match its images is a ``ValueError`` before the schedule's first send.

With tensor parallelism each stage's language-model layers are split by ``transformers``' plan (the head colwise,
the vocabulary-parallel loss on the last stage) and the vision tower is replicated over tp on the first stage.

Collectives: the pipeline's (``pipeline/runner.py``) and the plan's; none added. Freezing the vision side
(``freeze_vision=True``) leaves it without gradients on the first stage. Refused before any collective: packed rows
(restarting ``position_ids`` / ``seq_idx`` / ``cu_seqlens``: Qwen's M-RoPE positions are computed from the grid) and
videos (``pixel_values_videos`` is not a batch key).
"""
from __future__ import annotations

import inspect

import torch

from ..generic.pipeline_stage import GenericCausalLMPipelineAdapter

IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "token_type_ids",
              "mm_token_type_ids")
PER_ROW = "_per_row"


def image_token_id(config) -> int:
    """The image placeholder token of an image-text config (``image_token_id``, older ``image_token_index``)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(config).__name__} names no image token (image_token_id)")


def images_per_row(input_ids: torch.Tensor, token: int) -> torch.Tensor:
    """``[b]``: the runs of ``token`` in each row of ``input_ids [b, s]`` (one run per image)."""
    image = input_ids == token
    before = torch.nn.functional.pad(image, (1, 0))[:, :-1]
    return (image & ~before).sum(1)


def group_by_row(value: torch.Tensor, units: list[int], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``value`` ``[sum(units), ...]`` (image ``i`` its ``units[i]`` entries, images in row order; ``rows[r]`` images
    in row ``r``) as ``[b, n_max, ...]`` zero-padded and the entries per row ``[b]``."""
    per_row, start, parts = [], 0, []
    bounds = torch.tensor([0, *units]).cumsum(0).tolist()
    for count in rows:
        stop = start + count
        parts.append(value[bounds[start]:bounds[stop]])
        per_row.append(bounds[stop] - bounds[start])
        start = stop
    width = max(per_row, default=0)
    padded = value.new_zeros((len(rows), width, *value.shape[1:]))
    for row, part in enumerate(parts):
        padded[row, :part.shape[0]] = part
    return padded, torch.tensor(per_row, device=value.device)


def ungroup(padded: torch.Tensor, per_row: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`group_by_row` for some rows: their entries concatenated in row order."""
    return torch.cat([padded[row, :int(count)] for row, count in enumerate(per_row.tolist())])


class ImageTextPipelineAdapter(GenericCausalLMPipelineAdapter):
    """The generic pipeline adapter with an image-text model's image inputs (see the module docstring)."""

    batch_keys = (*GenericCausalLMPipelineAdapter.batch_keys, *IMAGE_KEYS)
    #: what every stage is given besides the tokens (the others: the first stage only)
    every_stage = ("image_grid_thw", "token_type_ids", "mm_token_type_ids")

    def prepare_batch(self, model, batch):
        """Refusals first (on every rank, before the schedule's first send), then each image-indexed tensor grouped
        by row (module docstring)."""
        packed = sorted({"position_ids", "seq_idx", "cu_seqlens"} & set(batch))
        if packed:
            raise NotImplementedError(f"pipelined image-text models take one sample per row: packed rows ({packed}) "
                                      f"are not implemented (Qwen-VL's M-RoPE positions are computed from the "
                                      f"image grids per row)")
        batch = super().prepare_batch(model, batch)
        if "pixel_values" not in batch:
            return batch
        batch_major = "pixel_attention_mask" in inspect.signature(type(model).forward).parameters
        if batch_major:  # Idefics3 / SmolVLM: pixel_values [b, images, 3, H, W] already by row
            return batch
        rows = images_per_row(batch["input_ids"], image_token_id(model.config))
        grid = batch.get("image_grid_thw")
        images = grid.shape[0] if grid is not None else batch["pixel_values"].shape[0]
        if int(rows.sum()) != images:
            raise ValueError(f"a pipelined {type(model).__name__} splits its images into microbatches by row, one run "
                             f"of image tokens per image: the batch's rows hold {int(rows.sum())} runs of image "
                             f"tokens for {images} images")
        rows = rows.tolist()
        for key in ("pixel_values", "image_grid_thw", "image_sizes"):
            if key in batch:
                units = grid.prod(-1).tolist() if key == "pixel_values" and grid is not None else [1] * images
                batch[key], batch[key + PER_ROW] = group_by_row(batch[key], units, rows)
        return batch

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        """``input_ids [mb, s]`` into the first stage, hidden states ``[mb, s, h]`` (the language model's width: the
        image-text config has none of its own) between stages, the logits ``[mb, s, V]`` out of the last (under tp
        this rank's vocabulary slice ``[mb, s, V/tp]``)."""
        mb, seq_len = microbatch["input_ids"].shape
        dtype = self._dtype(model)
        hidden = torch.empty(mb, seq_len, self.pieces.hidden_size, dtype=dtype, device="meta")
        inputs = (microbatch["input_ids"],) if stage == 0 else (hidden,)
        if stage < layout.num_stages - 1:
            return inputs, (hidden,)
        weight = model.get_output_embeddings().weight  # under tp this rank's vocabulary slice (colwise head)
        vocab = (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]
        return inputs, (torch.empty(mb, seq_len, vocab, dtype=dtype, device="meta"),)

    def stage_forward(self, stage, x, statistics=None, attention_mask=None, token_ids=None, position_ids=None,
                      seq_idx=None, **images):
        """As the generic stage (``x``: ``input_ids [mb, s]`` on the first stage, else hidden states ``[mb, s, h]``),
        with the microbatch's image inputs: the vision inputs on the first stage only, the grids and token types on
        every stage."""
        extra = {}
        for key in IMAGE_KEYS:
            if key not in images or (key not in self.every_stage and not stage.is_first):
                continue
            value = images[key]
            if key + PER_ROW in images:
                value = ungroup(value, images[key + PER_ROW])
                if value.shape[0] == 0:  # no image in these rows
                    continue
            extra[key] = value
        if extra.get("pixel_values") is None:
            extra.pop("image_sizes", None)
        return self._run_stage(stage, x, attention_mask, token_ids, position_ids, seq_idx, extra)
