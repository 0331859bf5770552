"""One forward of a generic model on ``transformers``' own dummy inputs, leaving no trace: what the structural checks
of a tensor-parallel plan (``partial_gradients.py``, ``inplace_outputs.py``) run the model on.

The model runs in eval mode (no dropout; training-only branches such as router jitter stay off) on
``model.dummy_inputs`` (``transformers``' small batch of token ids, or the model's own override; its first row's
first two tokens; under sequence
parallelism repeated to a length the tp size divides; under context parallelism this rank's chunk of it), without a
cache,
with the RNG state of the device restored afterwards (a later training run draws the same masks as without the
check). Collectives: the model's own (every tp rank runs it).
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn


def dummy_forward(model: nn.Module, context, *, grad: bool):
    """The output of one forward of ``model`` on its dummy inputs, with autograd recording when ``grad``."""
    inputs = {key: value[:1, :2].to(context.device) if isinstance(value, torch.Tensor) and value.dim() == 2
              else value.to(context.device) if isinstance(value, torch.Tensor) else value
              for key, value in dict(model.dummy_inputs).items()}  # its first row's first 2 tokens: a small graph
    if context.config.sequence_parallel or context.cp_size > 1:  # a length the tp ranks (x 2 cp chunks) split
        repeat = (context.tp_size if context.config.sequence_parallel else 1) * 2 * context.cp_size
        inputs = {key: value.repeat(1, repeat) if isinstance(value, torch.Tensor) and value.dim() == 2 else value
                  for key, value in inputs.items()}
    if context.cp_size > 1:  # this cp rank's chunk(s), as training.prepare's loader gives them
        from ..parallel_layers.context_parallel.chunking import split_sequence

        mode = context.config.context_parallel_mode
        inputs = {key: split_sequence(value, context.cp_rank, context.cp_size, mode)
                  if isinstance(value, torch.Tensor) and value.dim() == 2 else value for key, value in inputs.items()}
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False
    was_training = model.training
    devices = [context.device] if context.device.type == "cuda" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices), (torch.enable_grad() if grad else torch.no_grad()):
            if getattr(model, "pipeline_layout", None) is not None:  # cut into stages: each local stage runs alone
                from .pipeline_stage import local_stage_outputs

                return local_stage_outputs(model, inputs["input_ids"])
            return model(**inputs)
    finally:
        model.train(was_training)


@contextlib.contextmanager
def refused_on_error(model: nn.Module, context):
    """A forward that fails at tp > 1 (a plan ``transformers`` cannot run for this type) becomes a
    ``NotImplementedError`` naming the type and the plan."""
    try:
        yield
    except RuntimeError as error:
        raise NotImplementedError(
            f"{type(model).__name__}: transformers' tensor-parallel plan for {model.config.model_type!r} does not run "
            f"at tensor_parallel_size={context.tp_size} ({str(error).splitlines()[0][:300]}); use "
            f"tensor_parallel_size=1 for this type") from error
