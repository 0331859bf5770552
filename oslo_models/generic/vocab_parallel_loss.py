"""The vocabulary-parallel loss for generic causal LMs: no tp rank holds the full-vocabulary logits of a training step.

``transformers``' plans give the LM head ``colwise_gather_output``: every tp rank all-gathers the ``[b, s, V]`` logits
and computes the whole cross-entropy, so the largest activation of a training step is whole on every rank. The
generic path applies the head as ``colwise`` instead (each rank's logits are its vocabulary slice, ``[b, s, V/tp]``;
with a vocabulary the tp size does not divide, the last rank's slice is shorter, as DTensor's ``Shard`` cuts it) and
gives the model a loss function (``model.loss_function``, ``transformers``' own extension point) that computes
``transformers``' causal-LM loss from the slices: ``parallel_layers.cross_entropy.causal_lm_loss`` (labels shifted
left or ``shift_labels`` as given, ``-100`` ignored, the sum divided by ``num_items_in_batch`` when given, else by
the label count), with three all-reduces of ``[tokens]`` over tp in the forward and none in the backward.

What the forward returns: with the loss computed (``labels`` given), ``output.logits`` is this rank's vocabulary
slice; without it (inference, ``generate``, post-training scorers), a forward hook all-gathers the logits over tp
(differentiably), so the model returns the whole vocabulary as before.

Applies to a causal LM (``loss_type == "ForCausalLM"``) whose forward routes its loss through
``self.loss_function`` and whose output embeddings are an ``nn.Linear`` the plan gives ``colwise_gather_output``
(or ``colwise_rep``); other heads keep the plan's style. No collective at setup.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

_GATHERED_STYLES = ("colwise_gather_output", "colwise_rep")


def head_name(model: nn.Module, plan: dict[str, str], styles=_GATHERED_STYLES) -> str | None:
    """The name of the LM head this module splits by vocabulary (its plan style one of ``styles``), or ``None``
    when it does not apply."""
    if getattr(model, "loss_type", None) != "ForCausalLM":
        return None
    try:
        if "self.loss_function" not in inspect.getsource(type(model).forward):
            return None  # the model computes its loss itself: it would see only its slice
    except (OSError, TypeError):
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return None
    name = next((n for n, module in model.named_modules() if module is head), None)
    return name if name is not None and plan.get(name) in styles else None


def split_head(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``plan`` with the LM head's gathered style replaced by ``colwise`` (its output left split by vocabulary)."""
    name = head_name(model, plan)
    return plan if name is None else {**plan, name: "colwise"}


class VocabParallelCausalLMLoss:
    """``transformers``' ``ForCausalLMLoss`` signature on this rank's vocabulary slice of the logits."""

    def __init__(self, group, vocab_start: int):
        self.group, self.vocab_start = group, vocab_start

    def __call__(self, logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index: int = -100,
                 shift_labels=None, **kwargs):
        from ..parallel_layers.cross_entropy import causal_lm_loss

        return causal_lm_loss(logits, labels, group=self.group, vocab_start=self.vocab_start,
                              ignore_index=ignore_index, num_items_in_batch=num_items_in_batch,
                              shift_labels=shift_labels)


def vocab_start(vocab_size: int, tp_size: int, tp_rank: int) -> int:
    """The first vocabulary id of ``tp_rank``'s slice (DTensor ``Shard``: chunks of ``ceil(V / tp)`` rows)."""
    return min(tp_rank * -(-vocab_size // tp_size), vocab_size)


def install(model: nn.Module, context, plan: dict[str, str]) -> bool:
    """Give ``model`` the vocabulary-parallel loss and the gathering hook when ``plan`` (as applied) splits its head
    by vocabulary; returns whether it did."""
    if head_name(model, plan, styles=("colwise",)) is None:
        return False
    from torch.distributed.tensor import DTensor, Replicate, Shard

    head = model.get_output_embeddings()
    vocab = head.out_features
    model.loss_function = VocabParallelCausalLMLoss(context.tp_group, vocab_start(vocab, context.tp_size,
                                                                                context.tp_rank))
    mesh = context.mesh["tp"]

    def gather_without_loss(module, args, output):
        logits = getattr(output, "logits", None)
        if getattr(output, "loss", None) is not None or logits is None or logits.shape[-1] == vocab:
            return output
        shape = (*logits.shape[:-1], vocab)
        split = DTensor.from_local(logits, mesh, [Shard(logits.dim() - 1)], run_check=False, shape=shape,
                                   stride=torch.empty(shape, device="meta").stride())
        output["logits"] = split.redistribute(placements=[Replicate()]).to_local()
        return output

    model.register_forward_hook(gather_without_loss)
    return True
