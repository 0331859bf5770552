"""The same sampled tokens on every tensor-parallel rank: rank 0 of the group lends its RNG state to the others.

Under tensor parallelism every rank of a group runs ``generate`` on the same prompt and holds the same gathered
logits, but each draws its tokens (``torch.multinomial`` in sampling, beam-sampling and assisted modes) from its
*own* RNG. Ranks seeded differently (a common data-parallel habit: ``torch.manual_seed(base + rank)``) then pick
different tokens with no error, and when one of them samples EOS earlier it leaves the decode loop while the others
wait in the next forward's all-reduce.

:func:`sampling_rng_of_group_source` makes the draws agree without touching ``transformers``' decode loop: for the
duration of ``generate`` every rank of the tensor-parallel group uses the RNG state of the group's rank 0 (its CPU
generator, and the current CUDA device's on GPU), broadcast once at the start. The draws are then the draws of
rank 0, which behaves exactly as single-process ``transformers`` seeded like it (its RNG advances as there). The
other ranks get their own RNG state back afterwards, as if ``generate`` had drawn nothing from it.

Collective: one broadcast of the RNG state(s) over the tensor-parallel group per ``generate`` call. Data-parallel
replicas are independent (different prompts, different seeds): nothing runs across them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _broadcast_state(state: torch.Tensor, context, source: int) -> torch.Tensor:
    """``state`` (a ``uint8`` RNG state) of the group's source rank, on every rank of the tensor-parallel group."""
    buffer = state.to(context.device)
    dist.broadcast(buffer, src=source, group=context.tp_group)
    return buffer.cpu()


@contextlib.contextmanager
def sampling_rng_of_group_source(context):
    """Inside the block, every rank of ``context``'s tensor-parallel group draws from tp rank 0's RNG state.

    Rank 0 keeps its advanced state on exit; the other ranks get theirs back. A no-op without tensor parallelism.
    """
    if context.tp_size == 1 or context.tp_group is None:
        yield
        return
    source = dist.get_global_rank(context.tp_group, 0)
    is_source = context.tp_rank == 0
    cuda_devices = [context.device] if context.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices, enabled=not is_source):
        torch.set_rng_state(_broadcast_state(torch.get_rng_state(), context, source))
        for device in cuda_devices:
            torch.cuda.set_rng_state(_broadcast_state(torch.cuda.get_rng_state(device), context, source), device)
        yield


def check_can_generate(model) -> None:
    """Clear errors for ``generate`` calls that cannot run, before any collective: a head without generation,
    and a pipelined model (each rank holds only its stages' layers)."""
    from transformers import GenerationMixin

    if not isinstance(model, GenerationMixin):
        raise AttributeError(f"{type(model).__name__} has no generate(): it is not a generative head")
    context = model.parallel_context
    if context.pp_size > 1:
        raise RuntimeError(f"{type(model).__name__}.generate() cannot run with pipeline_parallel_size="
                           f"{context.pp_size}: each rank holds only its stages' layers. Save the trained model "
                           f"with save_pretrained() and load it without pipelining (tensor_parallel_size > 1 "
                           f"splits it for inference) to generate.")


def check_grid_batch(model, args: tuple, kwargs: dict) -> None:
    """Under a grid tensor-parallel mode (2D / 2.5D / 3D), a prompt batch the grid cannot split into its batch
    blocks is a ``ValueError`` before any collective (every rank raises the same one). The batch is read from the
    first batch-major input ``generate`` got (prompts, mask, embeddings or encoder outputs)."""
    context = model.parallel_context
    if not context.is_grid:
        return
    from ..parallel_layers.grid_boundary import check_generate_batch

    encoder_outputs = kwargs.get("encoder_outputs")
    if encoder_outputs is not None and not torch.is_tensor(encoder_outputs):
        encoder_outputs = encoder_outputs[0]
    candidates = (args[0] if args else None, kwargs.get("inputs"), kwargs.get("input_ids"),
                  kwargs.get("inputs_embeds"), kwargs.get("attention_mask"), encoder_outputs)
    batch = next((value.shape[0] for value in candidates if torch.is_tensor(value) and value.ndim > 0), None)
    if batch is not None:
        check_generate_batch(batch, context)


@contextlib.contextmanager
def unsharded_root(model):
    """Under ZeRO-3 (FSDP2 ``fully_shard`` on the model), hold the root's own parameters gathered for the whole
    block. ``generate`` of an encoder-decoder calls ``get_encoder()(...)`` directly, outside the root's pre-forward
    hook, and the root group holds what the blocks do not (the shared embeddings, the final norms): without this the
    encoder would meet sharded ``DTensor`` embeddings. One all-gather over data parallelism on entry; resharded on
    exit (the blocks keep their own hooks). Anything else: no-op."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
