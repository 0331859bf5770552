"""``num_items_in_batch`` honoured by every generic-path model, also one whose ``forward`` ignores it.

The global-batch loss (``training/global_batch.py``) hands every model ``num_items_in_batch`` and expects the summed
token losses divided by it. ``transformers``' decoders route their loss through ``self.loss_function``, which does
exactly that; many encoders (BERT's masked LM, token classification, Marian/Pegasus seq2seq) compute a plain
``CrossEntropyLoss()`` mean of their own and silently drop the argument (their ``**kwargs`` swallow it), which
would turn the step back into a per-replica mean.

:func:`install` makes the model honour it through two public extension points, nothing patched: the model's
``loss_function`` (``transformers``' setter) is wrapped to note that the model used it, and a forward hook checks
afterwards. When a forward received ``labels`` and ``num_items_in_batch`` and the model did not call its
``loss_function``, the loss is recomputed from the returned ``logits``: the sum of the token cross-entropies
(``ignore_index=-100``; labels shifted left for a causal LM, as-is for masked LM, token classification and
encoder-decoders) divided by ``num_items_in_batch``. A model whose own loss is of another kind (``loss_type`` not
one of those) raises ``ValueError`` there instead of training on a per-replica mean. No collective.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_TOKEN_LOSS_TYPES = ("ForCausalLM", "ForMaskedLM", "ForTokenClassification", "ForConditionalGeneration")


class _RecordingLoss:
    """The model's ``loss_function``, noting each call (the forward hook reads and clears the note)."""

    def __init__(self, loss_function):
        self.loss_function, self.called = loss_function, False

    def __call__(self, *args, **kwargs):
        self.called = True
        return self.loss_function(*args, **kwargs)


def _recomputed_loss(model, logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    from ..training.global_batch import loss_shifts_labels

    loss_type = getattr(model, "loss_type", None)
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    if loss_type not in _TOKEN_LOSS_TYPES and not encoder_decoder:
        raise ValueError(
            f"{type(model).__name__} computes its loss itself (loss_type={loss_type!r}, not through "
            "self.loss_function) and ignores num_items_in_batch, and its loss is not a token cross-entropy this "
            "library can recompute from the logits: the global-batch token average cannot be applied. Pass "
            "average_tokens_across_devices=False (training.prepare / TrainingArguments) for a per-replica mean")
    labels = labels.to(logits.device)
    if loss_shifts_labels(model):
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                            reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def install(model) -> None:
    """Make ``model`` (a ``transformers`` class on the generic path) honour ``num_items_in_batch``; idempotent."""
    if isinstance(getattr(model, "_loss_function", None), _RecordingLoss):
        return
    recording = _RecordingLoss(model.loss_function)
    model.loss_function = recording

    def before(module, args, kwargs):
        recording.called = False

    def after(module, args, kwargs, output):
        labels, items = kwargs.get("labels"), kwargs.get("num_items_in_batch")
        if labels is None or items is None or recording.called or not torch.is_tensor(labels) or labels.dim() < 2:
            return output
        logits = getattr(output, "logits", None)
        if logits is None or not hasattr(output, "__setitem__") or isinstance(output, tuple):
            raise ValueError(f"{type(module).__name__}: num_items_in_batch needs the model's output as a ModelOutput "
                             "with logits (return_dict=True) to recompute a loss the model averaged itself")
        output["loss"] = _recomputed_loss(module, logits, labels, items)
        return output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)
