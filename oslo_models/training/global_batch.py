"""The loss of a training step is the global batch's: summed token losses over every replica / the global count.

``transformers``' Trainer (``average_tokens_across_devices``), torchtitan and Megatron (``calculate_per_token_loss``)
divide the summed per-token losses of the *whole* global batch (every data-parallel replica, context-parallel chunk,
pipeline microbatch and gradient-accumulation micro-step) by the number of label tokens in it. A per-replica mean
followed by DDP's average weighs a replica with 11 label tokens as much as one with 34: with prompt masks, masked-LM
rates or padding that vary per row, the gradients differ from the single-GPU run on the same batch.

How it is done here, with no change to the user's loop (``loss = model(**batch).loss; accelerator.backward(loss)``):
the loader that :func:`~oslo_models.training.prepare` returns reads the batches of one optimizer step ahead (the
gradient-accumulation window), counts their label tokens, all-reduces the count once over the data ranks (``dp x
cp``; tensor- and pipeline-parallel ranks hold copies of the same batch and are not counted again), and attaches
``num_items_in_batch`` to every batch: this rank's *share* of the divisor,

    share = max(N_global, 1) / (dp * cp * gradient_accumulation_steps)

Every model divides its summed token losses by ``num_items_in_batch`` (native heads; the generic path through
``generic/token_loss.py``), a context-parallel model sums the shares of its ``cp`` chunks (``context_num_items``),
``accelerator.backward`` divides by the accumulation steps and DDP / ZeRO / the pipeline average over ``dp`` (``x
cp``, whose backward scales by ``cp``): the gradient is exactly that of ``sum(token losses) / N_global``. A batch
with no label token anywhere gives loss 0 (the divisor is at least 1) and its ranks still join every collective.

The loss a rank's forward returns is then ``replica_sum * dp * accumulation_steps / N_global``: its mean over the data
ranks and micro-steps (what the examples log with ``accelerator.reduce(..., "mean")``) is the global loss, on every
rank. ``average_tokens_across_devices=False`` keeps DDP's classic per-replica mean (each micro-step divides by its own
replica's label count); the peers' default is the global one.

Sequence-level losses (classification, multiple choice, QA: ``labels`` of shape ``[batch]`` or no ``labels``) get no
count: their per-row mean over equal-sized replicas already is the global batch's. Pre-training heads that add a
sentence loss to a token loss of their own kind (BERT / ALBERT ``ForPreTraining``, ELECTRA's replaced-token
detection) are not token cross-entropies divided by ``num_items_in_batch`` (:func:`loss_is_per_token`): they get no
count either and average per replica, as ``transformers``' Trainer leaves them; ``prepare`` says so once.

Collectives: one all-reduce (sum) of a scalar over ``dp_cp`` per optimizer step, before any forward of that step.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def _averages_its_own_cross_entropy(model_class) -> bool:
    """A ``transformers`` class whose ``forward`` runs a plain ``CrossEntropyLoss`` instead of its
    ``loss_function`` (e.g. ``BartForCausalLM`` and its copies: their causal-LM loss does not shift)."""
    import inspect

    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False
    return "CrossEntropyLoss" in source and "loss_function" not in source


def loss_shifts_labels(model) -> bool:
    """Whether ``model``'s loss shifts ``labels`` left (a causal LM). A class may say so itself
    (``labels_shifted_in_loss``); otherwise ``transformers``' own rule (what its Trainer counts with): the class's
    ``loss_type`` maps to the causal-LM loss and the model is not an encoder-decoder, unless its ``forward`` averages
    a plain ``CrossEntropyLoss`` of its own (``BartForCausalLM``: no shift)."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    from .zero import unwrap_model

    model = unwrap_model(model)
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    declared = getattr(type(model), "labels_shifted_in_loss", None)
    if declared is not None:
        return bool(declared)
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    causal = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss and not encoder_decoder
    return causal and not _averages_its_own_cross_entropy(type(model))


def loss_is_per_token(model) -> bool:
    """Whether ``model``'s loss is a token cross-entropy that divides by ``num_items_in_batch`` (causal / masked LM,
    token classification, encoder-decoder LM); ``False`` for sequence-level heads (classification, QA, multiple
    choice), whose per-row mean over equal-sized replicas is already the global batch's."""
    from .zero import unwrap_model

    model = unwrap_model(model)
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return True
    return getattr(model, "loss_type", None) in ("ForCausalLM", "ForMaskedLM", "ForTokenClassification",
                                                 "ForConditionalGeneration")


def loss_targets(batch, *, shifts_labels: bool):
    """The targets the loss of ``batch`` averages over, aligned with the logits: ``shift_labels`` when the batch
    carries them (context parallelism, packing collators), else ``labels`` (without their first column when the
    loss shifts); ``None`` for a sequence-level loss (no ``labels``, or ``labels`` of shape ``[batch]``)."""
    if not isinstance(batch, dict):
        return None
    if torch.is_tensor(batch.get("shift_labels")):
        return batch["shift_labels"]
    labels = batch.get("labels")
    if not torch.is_tensor(labels) or labels.dim() < 2:
        return None
    return labels[..., 1:] if shifts_labels else labels


def count_label_tokens(batches, *, shifts_labels: bool) -> torch.Tensor | None:
    """Label tokens (``!= -100``) of ``batches`` (an int64 scalar), or ``None`` when none of them has token
    labels."""
    counts = [(targets != IGNORE_INDEX).sum() for targets in
              (loss_targets(batch, shifts_labels=shifts_labels) for batch in batches) if targets is not None]
    return torch.stack(counts).sum() if counts else None


def global_share(local_count: torch.Tensor, context, accumulation_steps: int = 1) -> torch.Tensor:
    """``max(N_global, 1) / (dp * cp * accumulation_steps)`` as float32 on ``context.device``, ``N_global`` the sum of
    ``local_count`` over ``dp_cp`` (one all-reduce; every data rank must call it)."""
    total = local_count.detach().to(device=context.device, dtype=torch.float32).reshape(())
    if context.dp_cp_size > 1:
        total = total.clone()
        dist.all_reduce(total, group=context.dp_cp_group)
    return total.clamp(min=1.0) / (context.dp_cp_size * accumulation_steps)


def _attach(batch, value: torch.Tensor):
    out = dict(batch)
    out["num_items_in_batch"] = value
    return out


def _accelerate_state_mixin():
    try:
        from accelerate.data_loader import DataLoaderStateMixin
        from accelerate.state import GradientState
    except ImportError:  # pragma: no cover - accelerate is a dependency
        return object, None
    return DataLoaderStateMixin, GradientState


_StateMixin, _GradientState = _accelerate_state_mixin()


class GlobalBatchLoader(_StateMixin):
    """A loader that attaches ``num_items_in_batch`` (this rank's share of the global label count of its optimizer
    step, see the module docstring) to every batch of ``loader``; everything else passes through.

    It reads ``accumulation_steps`` batches ahead (one window = one optimizer step). For Accelerate's gradient
    accumulation it stands in for the inner loader in ``GradientState``: the end-of-data flag it shows for each batch
    is the one the inner loader showed when that batch was fetched, and the last batch of a short final window ends
    the epoch, so ``accelerator.accumulate`` steps exactly at the windows' ends. Under context parallelism a batch
    of full sequences (no ``shift_labels`` yet) is split into this rank's chunks first (``split``), so a plain
    ``DataLoader`` works at ``cp > 1``. ``state_dict`` / ``load_state_dict`` are the inner loader's, between windows
    (a checkpoint is taken after an optimizer step).

    Args:
        loader: yields dict batches of this data rank.
        context: the model's ``ParallelContext`` (``dp_cp`` group, ``device``).
        shifts_labels: the model's loss shifts ``labels`` (:func:`loss_shifts_labels`).
        accumulation_steps: micro-batches per optimizer step.
        average_tokens_across_devices: ``False``: each batch's own label count is attached instead (the per-replica
            mean of classic DDP), with no collective.
        token_loss: the model's loss is a token cross-entropy that divides by ``num_items_in_batch``
            (:func:`loss_is_per_token`); ``False``: nothing is attached.
        split: a callable applied to each batch before counting (``ContextParallelSplitter``), or ``None``.
    """

    def __init__(self, loader, *, context, shifts_labels: bool, accumulation_steps: int = 1,
                 average_tokens_across_devices: bool = True, split=None, token_loss: bool = True):
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.loader, self.context, self.shifts_labels = loader, context, shifts_labels
        self.accumulation_steps, self.average_tokens_across_devices = accumulation_steps, average_tokens_across_devices
        self.split, self.token_loss = split, token_loss
        self._pending = 0  # batches of the current window not yet handed out
        if _GradientState is not None:
            self.gradient_state = _GradientState()

    # ------------------------------------------------------------------ the loader's own attributes
    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):  # batch_size, dataset, sampler, set_epoch, ...: the inner loader's
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict:
        if self._pending:
            raise ValueError(f"the loader is {self._pending} batch(es) short of the end of a gradient-accumulation "
                             "window: save a checkpoint after an optimizer step")
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    # ------------------------------------------------------------------ iteration
    def _window_shares(self, window: list) -> list:
        if not self.token_loss:
            return [None] * len(window)
        if not self.average_tokens_across_devices:  # each batch's own count: no collective
            counts = [count_label_tokens([batch], shifts_labels=self.shifts_labels) for batch in window]
            return [None if count is None else count.to(device=self.context.device, dtype=torch.float32).clamp(min=1.0)
                    for count in counts]
        # None on every rank alike (the collator gives every rank the same keys): a sequence-level loss has no count.
        # Otherwise every data rank joins the all-reduce, also one whose labels are all -100 (its count is 0).
        local = count_label_tokens(window, shifts_labels=self.shifts_labels)
        if local is None:
            return [None] * len(window)
        return [global_share(local, self.context, self.accumulation_steps)] * len(window)

    def _prepare(self, batch):
        if self.split is not None and isinstance(batch, dict) and "shift_labels" not in batch:
            batch = self.split(batch)
        return batch

    def __iter__(self):
        inner = iter(self.loader)
        registered = False
        try:
            while True:
                window, flags = [], []
                for batch in itertools.islice(inner, self.accumulation_steps):
                    window.append(self._prepare(batch))
                    flags.append(bool(getattr(self.loader, "end_of_dataloader", False)))
                    if not registered and _GradientState is not None:
                        # after the inner loader registered itself: this wrapper is the active one from here on
                        self.begin()
                        registered = True
                if not window:
                    return
                short = len(window) < self.accumulation_steps
                shares = self._window_shares(window)
                self._pending = len(window)
                for index, (batch, share) in enumerate(zip(window, shares)):
                    last = index == len(window) - 1
                    self.end_of_dataloader = flags[index] or (short and last)
                    self.remainder = getattr(self.loader, "remainder", -1)
                    self._pending -= 1
                    yield batch if share is None else _attach(batch, share)
                if short:
                    return
        finally:
            self._pending = 0
            if registered:
                self.end()
