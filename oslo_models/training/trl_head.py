"""TRL's fused LM head contract, kept exact at any tensor-parallel size.

TRL (>= 1.x) makes ``SFTTrainer`` call ``model(**batch, fused_lm_head=True)`` and expect per-token fields instead of
logits (``trl.trainer.utils.FusedCausalLMOutput``: ``loss``, ``log_probs``, ``entropy``, ``is_top1``,
``label_mask``, each ``[b, s-1]`` and zero where the next-token label is ``-100``). It installs that behaviour by
replacing the model instance's ``forward`` with a function that runs the backbone and multiplies by
``get_output_embeddings().weight``. Under tensor parallelism that weight is this rank's vocabulary shard, so TRL's
head would score every token against ``V/tp`` rows only: a wrong, too low loss, silently.

``fused_lm_head_forward`` is the same contract computed from the model's own forward: its logits come gathered
over tp (``[b, s, V]``, every rank), the fields are a log-softmax over the whole vocabulary in fp32. Memory: the full
logits, as a plain ``transformers`` forward holds them. Under autocast (``SFTConfig`` defaults to ``bf16=True``) the
gradient flows through the model's bf16 logits, as in a plain ``transformers`` loss; TRL's chunked head accumulates its
backward in fp32, so there the two differ by a few bf16 ulps (equal in fp32: ``tests/adapters/test_trl.py``).
``ParallelTrainerMixin`` puts it in place of TRL's function on an ``oslo_models`` model.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F


def fused_lm_head_forward(self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None,
                          num_items_in_batch=None, **kwargs):
    """``model.forward`` with TRL's ``fused_lm_head`` switch (see the module docstring)."""
    forward = type(self).forward
    if not fused_lm_head:
        for name, value in (("labels", labels), ("shift_labels", shift_labels),
                            ("num_items_in_batch", num_items_in_batch)):
            if value is not None:
                kwargs[name] = value
        return forward(self, *args, **kwargs)
    from trl.trainer.utils import FusedCausalLMOutput

    kwargs["use_cache"] = False
    logits = forward(self, *args, **kwargs).logits.float()
    if shift_labels is None:
        logits, labels = logits[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    mask = labels != -100
    log_softmax = F.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1).detach().masked_fill(~mask, 0.0)
    is_top1 = (logits.argmax(-1) == labels) & mask
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                               is_top1=is_top1, label_mask=mask)


def replace_trl_head(model: torch.nn.Module) -> bool:
    """If TRL replaced ``model.forward`` (an instance attribute), put ``fused_lm_head_forward`` there instead;
    returns whether it did."""
    if "forward" not in vars(model) or not hasattr(vars(model)["forward"], "__wrapped__"):
        return False
    # keeps the class forward's signature (``generate`` validates its keyword arguments against it), as TRL does
    function = functools.wraps(type(model).forward)(functools.partial(fused_lm_head_forward))
    model.forward = types.MethodType(function, model)
    return True
