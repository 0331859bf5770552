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

An encoder-decoder's encoder is a boundary of its own when it is called from outside the model's forward:
``generate`` runs ``model.get_encoder()(input_ids=..., attention_mask=...)`` on the full batch, expands the result
for beams (``repeat_interleave`` over dim 0) and hands it back as ``encoder_outputs`` at every decoding step. So a
standalone encoder call splits its inputs and gathers ``last_hidden_state`` to ``[b, s, h]`` like the model does,
and the model's pre-hook cuts a given ``encoder_outputs`` to this rank's block (rows and hidden, the stream layout
the encoder ends in). Inside the model's forward the encoder sees the split inputs as before: its hooks do nothing.
The cache ``generate`` keeps holds this rank's rows only; ``local_beam_index`` turns beam search's reordering of
the global batch into the reordering of those rows.

``install(model, context)`` is called by ``ParallelPlan.apply`` on the outermost model only. A pipelined model
never runs its own forward: each ``StageModule`` splits its stage's inputs with ``split_stage_inputs`` instead,
and stages exchange their local blocks (``local_activation_shape``), each rank with the same grid position of
the neighbouring stage.
"""
from __future__ import annotations

import torch
from transformers.utils.generic import ModelOutput

from . import tensor_parallel_2d as tp2d
from . import tensor_parallel_3d as tp3d
from .mappings import gather_from_tensor_parallel_region
from .summa import Grid

# encoder_hidden_states / encoder_attention_mask: what a decoder alone with cross-attention takes (BartForCausalLM)
BATCH_MAJOR_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds",
                      "decoder_input_ids", "decoder_attention_mask", "decoder_inputs_embeds", "encoder_hidden_states",
                      "encoder_attention_mask")
HIDDEN_INPUTS = ("inputs_embeds", "decoder_inputs_embeds", "encoder_hidden_states")  # [b, s, h]: hidden split too
HIDDEN_OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state")


MASK_INPUTS = ("attention_mask", "decoder_attention_mask", "encoder_attention_mask")
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
    if name in HIDDEN_INPUTS:
        value = value.chunk(grid.q, dim=-1)[grid.row.rank]
    return value


def _split_encoder_outputs(value, grid: Grid):
    """A given ``encoder_outputs`` (HF layout, ``[b, s, h]`` first) as this rank's block, in a new object: the
    caller's (``generate`` passes the same one at every step) keeps the whole batch."""
    if isinstance(value, ModelOutput):
        if not torch.is_tensor(value.get("last_hidden_state")):
            return value
        out = type(value)(**value)
        out["last_hidden_state"] = _split("inputs_embeds", value["last_hidden_state"], grid)
        return out
    if isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):
        return (_split("inputs_embeds", value[0], grid), *value[1:])
    return value


class _Calls:
    """Which boundary modules split the inputs of the call now running: the model always (it is never nested in
    itself); its encoder only when no model forward is running (``generate``'s direct call). Set by the
    pre-hooks, cleared by the forward hooks, which run even when the forward raises (``always_call``)."""

    def __init__(self):
        self.split: dict[int, bool] = {}

    def inside_model(self) -> bool:
        return any(self.split.values())


def _split_inputs(grid: Grid, masks_inner: bool, calls: _Calls, inner: tuple[str, ...], *, standalone: bool):
    def hook(module, args, kwargs):
        if standalone and calls.inside_model():
            calls.split[id(module)] = False  # the model's forward already cut its inputs
            return args, kwargs
        calls.split[id(module)] = True
        if args:  # the first positional argument of every family's forward is input_ids
            args = (_split("input_ids", args[0], grid), *args[1:])
        labels = kwargs.get("labels")
        if (labels is not None and hasattr(module, "prepare_decoder_input_ids_from_labels")
                and kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None):
            # Seq2seq models derive the decoder inputs from the (whole-batch) labels: do it here, then split.
            kwargs["decoder_input_ids"] = module.prepare_decoder_input_ids_from_labels(labels=labels)
        kwargs = {name: _split(name, value, grid, masks_inner, inner) if name in BATCH_MAJOR_INPUTS else value
                  for name, value in kwargs.items()}
        if kwargs.get("encoder_outputs") is not None:
            kwargs["encoder_outputs"] = _split_encoder_outputs(kwargs["encoder_outputs"], grid)
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


def _gather_outputs(grid: Grid, calls: _Calls):
    def hook(module, args, kwargs, output):
        if not calls.split.pop(id(module), False) or output is None:  # nested, or the forward raised
            return output
        for name in HIDDEN_OUTPUTS:
            value = getattr(output, name, None) if not isinstance(output, tuple) else None
            if torch.is_tensor(value):
                full = grid.gather_rows(gather_from_tensor_parallel_region(value, grid.row.group, dim=-1))
                output[name] = full
        return output

    return hook


def install(model: torch.nn.Module, context) -> None:
    """The boundary hooks on ``model``, and on its encoder when it is an encoder-decoder (as ``generate`` decides:
    ``config.is_encoder_decoder``)."""
    grid, calls = Grid.from_context(context), _Calls()
    cube, inner = context.tensor_parallel_mode == "3d", getattr(model, "grid_inner_inputs", MASK_INPUTS)
    modules = [(model, False)]
    encoder = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) else None
    if isinstance(encoder, torch.nn.Module) and encoder is not model:
        modules.append((encoder, True))
    for module, standalone in modules:
        module.register_forward_pre_hook(_split_inputs(grid, cube, calls, inner, standalone=standalone),
                                         with_kwargs=True)
        module.register_forward_hook(_gather_outputs(grid, calls), with_kwargs=True, always_call=True)


def local_beam_index(beam_idx: torch.Tensor, context) -> torch.Tensor:
    """Beam search's reordering of the global batch (``beam_idx[r]``: the row whose cache row ``r`` takes) as the
    reordering of this rank's rows: the cache holds the batch block its attention ran on (the stream's block on
    the 2D / 2.5D grid, the inner layout's ``(z, x)`` on the 3D cube). Beams reorder within their prompt, and
    ``generate`` asks for a prompt batch the grid divides (``check_generate_batch``), so every block holds whole
    groups of beams and each of its rows takes a row of the same block."""
    grid = Grid.from_context(context)
    block = (grid.dep.rank * grid.q + grid.row.rank if context.tensor_parallel_mode == "3d"
             else grid.batch_rank)
    size = beam_idx.shape[0] // grid.batch_parts
    local = beam_idx[block * size:(block + 1) * size] - block * size
    assert bool(((local >= 0) & (local < size)).all()), "a beam moved across the grid's batch blocks"
    return local


def check_generate_batch(batch: int, context) -> None:
    """``ValueError`` before any collective when the grid cannot split a ``generate`` batch (the prompts; beams and
    returned sequences multiply it but keep each prompt's rows in one block)."""
    grid = Grid.from_context(context)
    if batch % grid.batch_parts:
        raise ValueError(f"generate() under tensor_parallel_mode={context.tensor_parallel_mode!r} got a batch of "
                         f"{batch} prompts, which the tensor-parallel grid cannot split: it splits the batch into "
                         f"{grid.batch_parts} blocks; pass a batch size divisible by {grid.batch_parts} (pad it "
                         f"with copies of a prompt and drop their outputs), or use tensor_parallel_mode='1d'")


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
