"""A sequence-tiled feed-forward (DeepSpeed ALST's ``TiledMLP``): the MLP runs on ``tiles`` slices of the sequence
one after the other, and its backward recomputes each slice, so no ``[b, s, ffn]`` tensor (nor its gradient) is ever
whole: the peak is one ``[b, s / tiles, ffn]`` slice, and nothing of the MLP's inside is kept for the backward.

``tiled_mlp(run, x, params, tiles)``: ``x [b, s, h]`` (``[b, s/tp, h]`` under sequence parallelism: this rank's
chunk, cut into ``tiles`` along dim 1), ``run`` the MLP (token-wise: each output token depends on its own input
token only), ``params`` every parameter ``run`` reads. Forward: ``run`` on each slice under ``no_grad``, the outputs
concatenated. Backward: for each slice, ``run`` again with gradients and ``torch.autograd.grad`` with respect to the
slice and ``params``; the slices' input gradients are concatenated, the parameter gradients summed and returned
through this node (the parameters are its inputs), so each parameter's gradient hook (DDP, FSDP2's reduce-scatter,
ZeRO) fires once per backward, as without tiling.

Collectives: the MLP's own, once per slice in the forward and again per slice in the backward's recompute and
gradient (a column-parallel input gathers / a row-parallel output reduces each slice; under sequence parallelism
every rank cuts its chunk into the same number of equal slices, so slice ``i`` of every rank is gathered together,
and the reduce-scatter hands each rank its own tokens back). The cost is one more MLP forward per step (as full
activation checkpointing pays), in ``tiles`` smaller matmuls.

Exactness: the result is the untiled MLP's up to the summation order of the parameter gradients (slices summed one
after another instead of in one matmul): equal to 1e-6 relative in fp32. Dropout inside the MLP would draw other
masks in the recompute: refused in training (``check_tileable``).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

from .sequence_parallel import SequenceParallelAware


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: Callable, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.run, ctx.tiles, ctx.params = run, tiles, params  # parameters by reference: no copy, no saved-tensor hook
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([run(piece) for piece in x.chunk(tiles, dim=1)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = ctx.params
        trained = [i for i, p in enumerate(params) if p.requires_grad]
        param_grads: list[torch.Tensor | None] = [None] * len(params)
        input_grads = []
        for piece, grad_piece in zip(x.chunk(ctx.tiles, dim=1), grad.chunk(ctx.tiles, dim=1)):
            piece = piece.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad():
                out = ctx.run(piece)
            wanted = ([piece] if x.requires_grad else []) + [params[i] for i in trained]
            grads = torch.autograd.grad(out, wanted, grad_piece.contiguous(), allow_unused=True)
            if x.requires_grad:
                input_grads.append(grads[0])
                grads = grads[1:]
            for i, g in zip(trained, grads):
                if g is not None:
                    param_grads[i] = g if param_grads[i] is None else param_grads[i] + g
        grad_x = torch.cat(input_grads, dim=1) if x.requires_grad else None
        return (None, None, grad_x, *param_grads)


def tiled_mlp(run: Callable, x: torch.Tensor, params, tiles: int) -> torch.Tensor:
    """``run(x)`` computed in ``tiles`` sequence slices, each recomputed in the backward (module docstring). Without
    gradients (evaluation) the slices run one after another and nothing is kept."""
    tiles = max(1, min(int(tiles), x.shape[1]))
    if tiles == 1:
        return run(x)
    if not torch.is_grad_enabled():
        return torch.cat([run(piece) for piece in x.chunk(tiles, dim=1)], dim=1)
    return _TiledMLP.apply(run, tiles, x, *params)


def tiles_for(seq_len: int, hidden: int, setting) -> int:
    """The number of slices for ``setting``: an int as given, ``"auto"`` ALST's rule ``ceil(s / h)`` (each slice
    about ``h`` tokens: its ``[h, ffn]`` intermediate no larger than the MLP's own weights)."""
    if setting == "auto":
        return max(1, -(-seq_len // hidden))
    return int(setting)


def check_tileable(mlp: nn.Module) -> None:
    """``ValueError`` for an MLP whose training forward draws dropout (the recompute would draw other masks)."""
    for name, module in mlp.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0 and module.training:
            raise ValueError(f"tiled_mlp: {type(mlp).__name__}.{name} has dropout p={module.p} in training; the "
                             "tiles' recompute would draw other masks. Set the MLP's dropout to 0 or turn "
                             "tiled_mlp off")


def check_tiles_setting(setting) -> None:
    """``ParallelConfig.tiled_mlp``: ``None`` (off), an int >= 1 (slices) or ``"auto"``; ``ValueError`` otherwise."""
    if setting is None or setting == "auto":
        return
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"tiled_mlp must be None, 'auto' or a number of sequence slices >= 1, got {setting!r}")


def tiled_module(mlp: nn.Module, x: torch.Tensor, setting) -> torch.Tensor:
    """``mlp(x)`` in the slices ``setting`` asks for (``tiles_for``), for a training forward. The backward's
    recompute runs after the stack left its sequence-parallel region: it re-enters the switch this forward saw
    (as activation checkpointing does), so its layers gather / reduce-scatter as they did."""
    check_tileable(mlp)
    run = mlp
    region = next((module.sequence_parallel_region for module in mlp.modules()
                   if isinstance(module, SequenceParallelAware) and module.sequence_parallel_region is not None), None)
    if region is not None:
        run = functools.partial(region.run, region.active, mlp)
    return tiled_mlp(run, x, tuple(mlp.parameters()), tiles_for(x.shape[1], x.shape[-1], setting))
