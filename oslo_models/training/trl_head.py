"""TRL's fused LM head contract, kept exact at any tensor-parallel size, on the vocab-split logits.

TRL (>= 1.x) makes its trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``KTOTrainer``)
call ``model(**batch, labels=..., fused_lm_head=True)`` and expect per-token fields instead of logits
(``trl.trainer.utils.FusedCausalLMOutput``: ``loss``, ``log_probs``, ``entropy``, ``log_sum_sq_probs``,
``mean_logits``, ``is_top1``, ``label_mask``, each ``[b, s-1]`` and zero where the next-token label is ``-100``).
It installs that behaviour by replacing the model instance's ``forward`` with a function that runs the backbone and
multiplies by ``get_output_embeddings().weight``. Under tensor parallelism that weight is this rank's vocabulary
shard, so TRL's head would score every token against ``V/tp`` rows only: a wrong, too low loss, silently.

``fused_lm_head_forward`` is the same contract computed from the model's own forward with the logits left split by
vocabulary (``gather_logits=False``: this rank's ``[b, s, V_padded/tp]``) through
:func:`oslo_models.losses.token_statistics`: one all-reduce MAX and one all-reduce SUM of ``[k, tokens]`` over the
tensor-parallel group in the forward, none in the backward; the ``[b, s, V]`` logits are never gathered. The
``temperature`` TRL's GRPO / RLOO scale the logits by is applied as there (``add_fused_lm_head(..., temperature)``).
A model whose forward has no ``gather_logits`` (``transformers``' own classes on the generic path) is scored on the
logits its forward returns (the whole vocabulary). Under autocast (``SFTConfig`` defaults to ``bf16=True``) the
gradient flows through the model's bf16 logits, as in a plain ``transformers`` loss; TRL's chunked head accumulates
its backward in fp32, so there the two differ by a few bf16 ulps (equal in fp32: ``tests/adapters/test_trl.py``).
``ParallelTrainerMixin`` puts it in place of TRL's function on an ``oslo_models`` model and its reference model.
"""
from __future__ import annotations

import functools
import inspect
import types

import torch


def fused_lm_head_forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                          num_items_in_batch=None, temperature: float = 1.0, **kwargs):
    """``model.forward`` with TRL's ``fused_lm_head`` switch (see the module docstring)."""
    forward = type(self).forward
    if not fused_lm_head:
        for name, value in (("labels", labels), ("shift_labels", shift_labels),
                            ("num_items_in_batch", num_items_in_batch)):
            if value is not None:
                kwargs[name] = value
        return forward(self, *args, **kwargs)
    from trl.trainer.utils import FusedCausalLMOutput

    from ..losses import FIELDS, VocabShard, token_statistics

    kwargs["use_cache"] = False
    if "gather_logits" in inspect.signature(forward).parameters:
        logits = forward(self, *args, gather_logits=False, **kwargs).logits
        shard = VocabShard.of(self)
    else:
        logits, shard = forward(self, *args, **kwargs).logits, VocabShard()
    if shift_labels is None:  # targets shifted left (not the logits cut: that would copy them); last column -100
        targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    else:
        targets = shift_labels
    targets = targets.to(logits.device)
    fields = token_statistics(logits, targets, shard=shard, outputs=FIELDS, temperature=temperature)
    if shift_labels is None:
        fields = {name: value[:, :-1] for name, value in fields.items()}
        targets = targets[:, :-1]
    mask = targets != -100
    fields = {name: value if name in ("log_probs", "is_top1") else value.masked_fill(~mask, 0)
              for name, value in fields.items()}
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, label_mask=mask, **fields)


def replace_trl_head(model: torch.nn.Module, *, temperature: float = 1.0, installed: bool = True) -> bool:
    """If TRL replaced ``model.forward`` (an instance attribute), put ``fused_lm_head_forward`` there instead (at
    ``temperature``: the one TRL's trainer gave ``add_fused_lm_head``); returns whether it did. ``installed=False``:
    give ``model`` the head whether TRL installed one or not (a reference loaded after TRL's ``__init__``)."""
    if installed and ("forward" not in vars(model) or not hasattr(vars(model)["forward"], "__wrapped__")):
        return False
    # keeps the class forward's signature (``generate`` validates its keyword arguments against it), as TRL does
    function = functools.wraps(type(model).forward)(functools.partial(fused_lm_head_forward, temperature=temperature))
    model.forward = types.MethodType(function, model)
    return True
