"""TRL's preference and RL trainers (``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``) at a tensor x data layout.

``ParallelTrainerMixin`` calls :func:`adapt_arguments` before the TRL trainer's ``__init__`` and
:func:`adapt_trainer` after it. What they change, and why:

- the reference model. ``ref_model=None`` (no ``peft``, no precomputed reference log-probabilities) makes TRL reload
  the policy's checkpoint from ``config.name_or_path`` as a plain ``transformers`` model: a whole replica on every
  rank. Here it is loaded as the policy's own class at the policy's layout instead (its slices only, the same
  ``ParallelContext``), before TRL's ``__init__`` (DPO), or in place of the plain one TRL built (GRPO, RLOO).
- the fused LM head. TRL replaces the forward of the policy (the ``peft`` base model) and of the reference with a head
  that multiplies by ``lm_head.weight``, which under tensor parallelism is a vocabulary shard: both are replaced by
  ``trl_head.fused_lm_head_forward`` (vocab-parallel log-probabilities, entropy and TRL's statistics), at the
  ``temperature`` GRPO / RLOO sample and score with.
- GRPO / RLOO's generation batch. TRL sizes it ``per_device_train_batch_size x world x steps_per_generation`` and
  normalizes rewards within groups of the batch gathered over the world. Tensor-parallel ranks hold copies of their
  replica's rows, so the batch is sized over the data-parallel replicas, and each replica's share of a generation
  round must hold whole groups (``per_device_train_batch_size x steps_per_generation`` divisible by
  ``num_generations``): the gathered rewards are then each replica's groups repeated ``tp`` times (ranks are
  tp-innermost), the group statistics are those of the groups themselves, and each rank's slice is its replica's.
  Statistics over the whole batch (``scale_rewards="batch"``, ``multi_objective_aggregation="normalize_then_sum"``,
  RLOO's ``normalize_advantages``) would count every row ``tp`` times: refused at ``tp > 1``.
- GRPO / RLOO's random streams. TRL seeds every process with ``seed + process_index`` and shuffles each generation
  batch with it; tensor-parallel ranks drawing different permutations would compute on different rows. Every rank is
  seeded ``seed + dp_rank`` instead (``accelerate.utils.set_seed``: Python, NumPy, torch): the ranks of a replica draw
  alike, and replica ``d`` draws what process ``d`` of TRL's data-parallel run draws. The model's ``generate`` samples
  from tp rank 0's stream and gives the other ranks their own state back (``models/generation.py``); after each
  generation round the group takes rank 0's advanced state (:func:`share_tp_rng`, one broadcast), as one process
  would have it.
"""
from __future__ import annotations

import inspect

from .trl_head import replace_trl_head


def _base(model):
    from .zero import unwrap_model

    inner = unwrap_model(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _is_peft(model) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _at_layout(policy):
    """The policy's checkpoint loaded again as the policy's class at the policy's layout (frozen, eval mode)."""
    base = _base(policy)
    path = getattr(base, "name_or_path", "") or getattr(base.config, "_name_or_path", "")
    if not path:
        raise ValueError("ref_model=None: the reference is reloaded from the policy's checkpoint, but the model has "
                         "no name_or_path (built from a config?); pass ref_model= explicitly")
    reference = type(base).from_pretrained(path, parallel=base.parallel_context, dtype=base.dtype, progress=False)
    for param in reference.parameters():
        param.requires_grad_(False)
    return reference.eval()


def _check_generation_batch(args, context) -> None:
    """GRPO / RLOO: the generation batch over the data-parallel replicas, whole groups per replica (see above)."""
    per_replica = args.per_device_train_batch_size * args.steps_per_generation
    args.generation_batch_size = per_replica * context.dp_size
    if context.tp_size == 1:
        return
    if per_replica % args.num_generations:
        raise ValueError(
            f"At tensor_parallel_size={context.tp_size} each data-parallel replica must hold whole groups: "
            f"per_device_train_batch_size ({args.per_device_train_batch_size}) x steps_per_generation "
            f"({args.steps_per_generation}) must be divisible by num_generations ({args.num_generations})")
    batch_level = [name for name, value, plain in (
        ("scale_rewards='batch'", getattr(args, "scale_rewards", "group"), "batch"),
        ("multi_objective_aggregation='normalize_then_sum'", getattr(args, "multi_objective_aggregation", None),
         "normalize_then_sum"),
        ("normalize_advantages=True", getattr(args, "normalize_advantages", False), True)) if value == plain]
    if batch_level:
        raise NotImplementedError(
            f"{batch_level[0]} at tensor_parallel_size={context.tp_size} is not supported: TRL gathers the rewards "
            "over every process and tensor-parallel ranks hold copies of their replica's rows, so a statistic over "
            "the whole batch would count each row tp times (group statistics are exact)")
    ranks = context.tp_rank == context.rank % context.tp_size and context.world_size % context.tp_size == 0
    if not ranks:
        raise NotImplementedError("GRPO / RLOO at tp > 1 needs tensor-parallel ranks innermost (the 1D mode)")


def share_tp_rng(model) -> None:
    """Every rank of ``model``'s tensor-parallel group takes tp rank 0's torch RNG state (CPU, and the current CUDA
    device's on GPU): one broadcast per generator over the tp group; nothing at tp 1."""
    import torch
    import torch.distributed as dist

    context = getattr(_base(model), "parallel_context", None)
    if context is None or context.tp_size == 1:
        return
    source = dist.get_global_rank(context.tp_group, 0)
    states = [(torch.get_rng_state, torch.set_rng_state)]
    if context.device.type == "cuda":
        states.append((lambda: torch.cuda.get_rng_state(context.device),
                       lambda state: torch.cuda.set_rng_state(state, context.device)))
    for get, put in states:
        buffer = get().to(context.device)
        dist.broadcast(buffer, src=source, group=context.tp_group)
        put(buffer.cpu())


def adapt_arguments(trainer_init, model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for the TRL trainer's ``__init__`` at ``model``'s layout (module docstring)."""
    context = getattr(_base(model), "parallel_context", None)
    if context is None:
        return args, kwargs
    bound = inspect.signature(trainer_init).bind_partial(*args, **kwargs)
    config = bound.arguments.get("args")
    if config is not None and all(hasattr(config, name) for name in
                                  ("generation_batch_size", "steps_per_generation", "num_generations")):
        _check_generation_batch(config, context)
    if ("ref_model" in inspect.signature(trainer_init).parameters and bound.arguments.get("ref_model") is None
            and not _is_peft(model) and not getattr(config, "precompute_ref_log_probs", False)):
        bound.arguments["ref_model"] = _at_layout(model)
    return bound.args, bound.kwargs


def adapt_trainer(trainer) -> None:
    """After the TRL trainer's ``__init__``: the policy's and the reference's heads replaced, a plain reference
    TRL loaded replaced by one at the policy's layout (module docstring)."""
    policy = _base(trainer.model)
    context = getattr(policy, "parallel_context", None)
    temperature = getattr(trainer, "temperature", 1.0)
    replace_trl_head(policy, temperature=temperature)
    reference = getattr(trainer, "ref_model", None)
    if reference is not None and context is not None:
        if getattr(_base(reference), "parallel_context", None) is None:  # TRL reloaded the policy as plain
            trainer.ref_model = _at_layout(policy)
            replace_trl_head(trainer.ref_model, temperature=temperature, installed=False)
        else:
            replace_trl_head(_base(reference), temperature=temperature)
    if context is not None and hasattr(trainer.args, "generation_batch_size"):
        from accelerate.utils import set_seed

        set_seed(trainer.args.seed + context.dp_rank)
