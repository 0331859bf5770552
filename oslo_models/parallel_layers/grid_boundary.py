"""The public boundary of a model running a grid tensor-parallel mode (2D / 2.5D / 3D): HF's layout outside,
the batch split inside.

Users call the model with the full batch on every tensor-parallel rank, exactly as at 1D. A forward pre-hook
keeps this rank's batch block (``Grid.local_rows``) of every batch-major input (``input_ids``,
``attention_mask``, ``token_type_ids``, ``position_ids`` with a batch dim, ``decoder_*``), so the model code,
which builds masks from its inputs, sees a consistent smaller batch. ``labels`` stay whole: the vocab-parallel
cross-entropy takes this rank's rows itself and all-gathers the per-token losses, so the mean over the
global batch (or ``num_items_in_batch``) is the one ``transformers`` computes. On the way out, a forward hook
gathers ``last_hidden_state`` / ``encoder_last_hidden_state`` back to ``[b, s, h]``; LM heads gather their
logits themselves (``Linear2D.gather``). Inputs are integer tensors: splitting them has no backward.

``install(model, context)`` is called by ``ParallelPlan.apply`` on the outermost model only. A pipelined model
never runs its own forward: each ``StageModule`` splits its stage's inputs with ``split_stage_inputs`` instead,
and stages exchange their local blocks (``local_activation_shape``), each rank with the same grid position of
the neighbouring stage.
"""
from __future__ import annotations

import torch

from . import tensor_parallel_2d as tp2d
from . import tensor_parallel_3d as tp3d
from .mappings import gather_from_tensor_parallel_region
from .summa import Grid

BATCH_MAJOR_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                      "decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds")
HIDDEN_OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state")


MASK_INPUTS = ("attention_mask", "decoder_attention_mask")
# 3D: what attention reads runs in the inner layout. A family whose position ids feed only the attention (rotary:
# the Llama family) lists them too, in ``grid_inner_inputs`` on its model class.


def _split(name: str, value, grid: Grid, masks_inner: bool = False, inner: tuple[str, ...] = MASK_INPUTS):
    if not torch.is_tensor(value) or value.ndim == 0:
        return value
    if name == "position_ids" and value.shape[0] == 1:
        return value  # shared by every sequence of the batch
    if value.shape[0] % grid.batch_parts:
        raise ValueError(f"{name} has batch size {value.shape[0]}, which the tensor-parallel grid cannot split: "
                         f"it splits the batch into {grid.batch_parts} blocks (q={grid.q} grid rows x "
                         f"depth {grid.dep.size}); use a batch size divisible by {grid.batch_parts}")
    if masks_inner and name in inner:
        # 3D: attention runs in the inner layout (batch block (z, x), see tensor_parallel_3d.py), so the masks it
        # reads are split that way; everything else enters the stream (batch block (z, y)).
        value = value.chunk(grid.batch_parts, dim=0)[grid.dep.rank * grid.q + grid.row.rank]
    else:
        value = grid.local_rows(value)
    if name.endswith("inputs_embeds"):  # [b, s, h]: the hidden is split too
        value = value.chunk(grid.q, dim=-1)[grid.row.rank]
    return value


def _split_inputs(grid: Grid, masks_inner: bool):
    def hook(module, args, kwargs):
        inner = getattr(module, "grid_inner_inputs", MASK_INPUTS)
        if args:  # the first positional argument of every family's forward is input_ids
            args = (_split("input_ids", args[0], grid), *args[1:])
        labels = kwargs.get("labels")
        if (labels is not None and hasattr(module, "prepare_decoder_input_ids_from_labels")
                and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None):
            # Seq2seq models derive the decoder inputs from the (whole-batch) labels: do it here, then split.
            kwargs["decoder_input_ids"] = module.prepare_decoder_input_ids_from_labels(labels=labels)
        kwargs = {name: _split(name, value, grid, masks_inner, inner) if name in BATCH_MAJOR_INPUTS else value
                  for name, value in kwargs.items()}
        return args, kwargs

    return hook


def split_stage_inputs(model, names: tuple[str, ...], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A pipeline stage's view of one microbatch: the batch-major tensors among ``args`` (named ``names``: the
    first stage's inputs, e.g. ``input_ids``) and ``kwargs`` (masks, positions) cut to this rank's batch block,
    as the model-boundary hook does. ``args`` of other stages are activations already in the grid layout."""
    context = model.parallel_context
    grid, cube = Grid.from_context(context), context.tensor_parallel_mode == "3d"
    inner = getattr(model, "grid_inner_inputs", MASK_INPUTS)
    args = tuple(_split(name, value, grid, cube, inner) for name, value in zip(names, args)) + args[len(names):]
    kwargs = {name: _split(name, value, grid, cube, inner) if name in BATCH_MAJOR_INPUTS else value
              for name, value in kwargs.items()}
    return args, kwargs


def local_activation_shape(context, batch: int, hidden: int) -> tuple[int, int]:
    """``(batch, hidden)`` of this rank's block of a ``[batch, s, hidden]`` activation: ``batch / (d*q)`` rows
    and ``hidden / q`` columns on the 2D / 2.5D grid, ``batch / q**2`` and ``hidden / q`` on the 3D cube
    (both the stream and the inner layout). ``ValueError`` when the batch does not split."""
    grid = Grid.from_context(context)
    if batch % grid.batch_parts:
        raise ValueError(f"A microbatch of {batch} sequences cannot be split over the tensor-parallel grid, which "
                         f"splits the batch into {grid.batch_parts} blocks; use a batch size divisible by "
                         f"num_microbatches x {grid.batch_parts}")
    return batch // grid.batch_parts, hidden // grid.q


def _gather_outputs(grid: Grid):
    def hook(module, args, kwargs, output):
        for name in HIDDEN_OUTPUTS:
            value = getattr(output, name, None) if not isinstance(output, tuple) else None
            if torch.is_tensor(value):
                full = grid.gather_rows(gather_from_tensor_parallel_region(value, grid.row.group, dim=-1))
                output[name] = full
        return output

    return hook


def install(model: torch.nn.Module, context) -> None:
    grid = Grid.from_context(context)
    model.register_forward_pre_hook(_split_inputs(grid, context.tensor_parallel_mode == "3d"), with_kwargs=True)
    model.register_forward_hook(_gather_outputs(grid), with_kwargs=True)


def check_fully_planned(model: torch.nn.Module, mode: str) -> None:
    """Every module that owns parameters must be a grid layer: a plain one would see split activations and
    fail deep inside a matmul. Raised while the model is built, before any collective."""
    grid_layers = (tp2d.Linear2D, tp2d.LayerNorm2D, tp2d.VocabEmbedding2D, tp2d.HiddenEmbedding2D,
                   tp2d.RMSNorm2D, tp3d.Linear3D, tp3d.VocabEmbedding3D, tp3d.HiddenEmbedding3D)
    for name, module in model.named_modules():
        if isinstance(module, grid_layers) or getattr(module, "grid_planned", False) \
                or not any(True for _ in module.parameters(recurse=False)):
            continue
        raise NotImplementedError(
            f"tensor_parallel_mode={mode!r}: {type(model).__name__}.{name} ({type(module).__name__}) has "
            "parameters but no plan style that splits it over the grid; every activation is split over batch "
            "and hidden in this mode, so a replicated module cannot run. Use tensor_parallel_mode='1d' for this "
            "model, or add the module to its family's parallel plan.")
