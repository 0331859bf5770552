"""Token-level loss and logits of a vocab-parallel output layer (MLM decoders, seq2seq LM heads).

The decoder is a ``ColumnParallelLinear`` over a padded vocabulary: each rank holds logits
``[..., V_padded/tp]`` (padding columns are ``-inf``). The loss runs on those slices (three all-reduces, see
``parallel_layers.cross_entropy``); the full logits are built only for the returned output.
"""
from __future__ import annotations

import torch

from ...parallel_layers.cross_entropy import causal_lm_loss, vocab_parallel_cross_entropy


def token_loss(local_logits: torch.Tensor, labels: torch.Tensor, decoder, *, ignore_index: int = -100,
               num_items_in_batch=None) -> torch.Tensor:
    """``CrossEntropyLoss()`` of ``transformers``' MLM / seq2seq heads (no shift): mean over tokens whose label is
    not ``ignore_index`` (or sum / ``num_items_in_batch`` when given)."""
    labels = labels.to(local_logits.device)
    per_token = vocab_parallel_cross_entropy(local_logits.reshape(-1, local_logits.shape[-1]), labels.reshape(-1),
                                             group=getattr(decoder, "group", None),
                                             vocab_start=getattr(decoder, "vocab_start_index", 0),
                                             ignore_index=ignore_index)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(per_token.device)
        return per_token.sum() / num_items_in_batch
    return per_token.sum() / (labels != ignore_index).sum()


def causal_token_loss(local_logits: torch.Tensor, labels, decoder, *, num_items_in_batch=None,
                      shift_labels=None) -> torch.Tensor:
    """``transformers``' causal-LM loss (labels shifted left, or ``shift_labels`` as given) on this rank's
    vocabulary slice of the logits of ``decoder`` (a vocab-parallel or plain output layer)."""
    return causal_lm_loss(local_logits, labels, group=getattr(decoder, "group", None),
                          vocab_start=getattr(decoder, "vocab_start_index", 0), num_items_in_batch=num_items_in_batch,
                          shift_labels=shift_labels)


def keep_last_logits(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """``transformers``' ``logits_to_keep``: the last ``n`` positions (``0``: all), or the positions a tensor
    names, so generation projects only what it samples from."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep > 0 else hidden_states
    return hidden_states[:, logits_to_keep, :]


def full_logits(local_logits: torch.Tensor, decoder, gather: bool = True) -> torch.Tensor:
    """``[..., V]`` (all-gather; padding stripped) or, with ``gather=False``, this rank's ``[..., V_padded/tp]``."""
    if gather and hasattr(decoder, "gather"):
        return decoder.gather(local_logits)
    return local_logits


def lm_head_loss_and_logits(lm_head, hidden_states: torch.Tensor, labels=None, *, logits_to_keep=0,
                            gather_logits: bool = True, num_items_in_batch=None, shift_labels=None):
    """A decoder LM head as ``transformers``' ``*ForCausalLM.forward`` runs it: ``hidden_states [b, s, h]`` (only the
    last ``logits_to_keep`` positions, or those an index tensor picks) -> ``(loss, logits)``. The loss (labels
    shifted left, or ``shift_labels`` as given, alongside ``labels`` as in ``transformers``) runs on the
    vocab-split logits (``causal_lm_loss``); ``logits`` are gathered to ``[b, s, V]`` unless ``gather_logits=False``
    (then this rank's ``[b, s, V_padded/tp]``, padded columns ``-inf``)."""
    local_logits = lm_head(keep_last_logits(hidden_states, logits_to_keep))
    loss = None
    if labels is not None:
        loss = causal_token_loss(local_logits, labels, lm_head, num_items_in_batch=num_items_in_batch,
                                 shift_labels=shift_labels)
    return loss, full_logits(local_logits, lm_head, gather_logits)
