"""Token-level loss and logits of a vocab-parallel output layer (MLM decoders, seq2seq LM heads).

The decoder is a ``ColumnParallelLinear`` over a padded vocabulary: each rank holds logits
``[..., V_padded/tp]`` (padding columns are ``-inf``). The loss runs on those slices (three all-reduces, see
``parallel_layers.cross_entropy``); the full logits are built only for the returned output.

``skip_logits=True`` (the LM heads' forward argument, Liger's name): the caller wants only the loss, so the
head's matmul and the cross-entropy run fused and chunked (``fused_ops.linear_cross_entropy_loss``) and no
``[tokens, vocab]`` logits exist at any time; ``logits`` comes back ``None``. The default (``False``) keeps
``transformers``' behaviour of returning logits. The loss is the same (``ignore_index=-100``, label shift,
``num_items_in_batch``, the head's bias) at any 1D tensor-parallel size; under the 2D/2.5D/3D grid modes the
head is not a plain column-parallel layer and the loss runs on materialized logits (still not returned).
"""
from __future__ import annotations

import torch

from .... import fused_ops
from ....parallel_layers.cross_entropy import causal_lm_loss, vocab_parallel_cross_entropy
from ....parallel_layers.layers import Linear
from ....parallel_layers.tensor_parallel import ColumnParallelLinear


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


def soft_cap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2/3's final logit soft-capping ``cap * tanh(logits / cap)`` (``transformers``' order of operations), on
    full or vocab-split logits ``[..., V(_padded/tp)]``; ``cap=None``: ``logits`` unchanged. The padded columns of a
    vocab-parallel head stay ``-inf`` (capping would turn them into ``-cap`` and give the padding probability mass).
    Elementwise: no collective."""
    if cap is None:
        return logits
    capped = torch.tanh(logits / cap) * cap
    return capped.masked_fill(torch.isneginf(logits), float("-inf"))


def lm_head_loss_and_logits(lm_head, hidden_states: torch.Tensor, labels=None, *, logits_to_keep=0,
                            gather_logits: bool = True, num_items_in_batch=None, shift_labels=None,
                            skip_logits: bool = False, fused: bool = True, logit_softcap: float | None = None):
    """A decoder LM head as ``transformers``' ``*ForCausalLM.forward`` runs it: ``hidden_states [b, s, h]`` (only the
    last ``logits_to_keep`` positions, or those an index tensor picks) -> ``(loss, logits)``. The loss (labels
    shifted left, or ``shift_labels`` as given, alongside ``labels`` as in ``transformers``) runs on the
    vocab-split logits (``causal_lm_loss``); ``logits`` are gathered to ``[b, s, V]`` unless ``gather_logits=False``
    (then this rank's ``[b, s, V_padded/tp]``, padded columns ``-inf``); ``skip_logits``: see
    ``head_loss_and_logits``; ``logit_softcap``: the final logit soft-cap (``soft_cap_logits``) before the loss."""
    return head_loss_and_logits(lm_head, keep_last_logits(hidden_states, logits_to_keep), labels, causal=True,
                                skip_logits=skip_logits, fused=fused, gather_logits=gather_logits,
                                num_items_in_batch=num_items_in_batch, shift_labels=shift_labels,
                                logit_softcap=logit_softcap)


def fused_loss_supported(decoder) -> bool:
    """Whether the chunked linear cross-entropy can stand in for ``decoder``: the plain ``Linear`` or the 1D
    vocab-parallel ``ColumnParallelLinear`` in ``nn.Linear`` layout (``[V, H]`` weight), not a gathered one."""
    if isinstance(decoder, ColumnParallelLinear):
        return decoder.layout == "linear" and not decoder.gather_output and decoder.num_packed == 1
    return type(decoder) is Linear and decoder.layout == "linear"


def head_loss(decoder, hidden_states: torch.Tensor, labels: torch.Tensor, *, causal: bool, fused: bool = True,
              ignore_index: int = -100, num_items_in_batch=None, shift_labels=None) -> torch.Tensor:
    """The loss of ``decoder(hidden_states)`` against ``labels`` without the logits: ``transformers``' causal-LM
    loss (``causal=True``: labels shifted left, or ``shift_labels``) or its MLM / seq2seq loss (no shift), mean
    over non-ignored tokens or sum / ``num_items_in_batch``. ``hidden_states [b, s, h]`` replicated over TP.

    Collectives (vocab-parallel ``decoder``): forward all-reduce MAX and SUM per chunk of rows; backward one
    all-reduce SUM of the hidden-state grad (what the head's own column-parallel input mapping would do)."""
    if causal and shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = (shift_labels if causal else labels).to(hidden_states.device)
    loss = fused_ops.linear_cross_entropy_loss(
        hidden_states, decoder.weight, targets, bias=decoder.bias, ignore_index=ignore_index,
        reduction="mean" if num_items_in_batch is None else "sum", group=getattr(decoder, "group", None),
        vocab_size=getattr(decoder, "vocab_size", None), enabled=fused)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def head_loss_and_logits(decoder, hidden_states: torch.Tensor, labels=None, *, causal: bool,
                         skip_logits: bool = False, fused: bool = True, gather_logits: bool = True,
                         num_items_in_batch=None, shift_labels=None, logit_softcap: float | None = None):
    """``(loss, logits)`` of an LM / MLM head whose last layer is ``decoder`` (``hidden_states`` already through
    any transform before it). ``skip_logits=True`` needs ``labels`` and returns ``logits=None``: the loss runs
    through ``head_loss`` (no logits at all) where ``fused_loss_supported(decoder)``, else on local logits that are
    then dropped. Otherwise as before: the loss on the vocab-split logits, ``logits`` gathered unless
    ``gather_logits=False``. ``logit_softcap``: the logits (and so the loss) are soft-capped first
    (``soft_cap_logits``); the fused loss-only kernel has no cap, so with one ``skip_logits`` takes the local-logits
    path (the loss is still right; only the memory saving is lost)."""
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True returns only the loss, so it needs labels")
    if skip_logits and logit_softcap is None and fused_loss_supported(decoder):
        return head_loss(decoder, hidden_states, labels, causal=causal, fused=fused,
                         num_items_in_batch=num_items_in_batch, shift_labels=shift_labels), None
    local_logits = soft_cap_logits(decoder(hidden_states), logit_softcap)
    loss = None
    if labels is not None:
        if causal:
            loss = causal_token_loss(local_logits, labels, decoder, num_items_in_batch=num_items_in_batch,
                                     shift_labels=shift_labels)
        else:
            loss = token_loss(local_logits, labels, decoder, num_items_in_batch=num_items_in_batch)
    return loss, None if skip_logits else full_logits(local_logits, decoder, gather_logits)
