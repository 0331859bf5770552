"""Held-out evaluation for the example scripts: mean loss and perplexity over ``--eval-data``, at every layout.

Convention (as ``transformers``' ``run_clm_no_trainer.py``): the eval loss is the mean over held-out samples of
their batch's mean loss, and perplexity is ``exp`` of it. The held-out windows are read in file order (no
shuffle), split over data-parallel ranks, and only whole batches on every dp rank are used, so every rank runs
the same number of steps and the figure does not depend on the layout. Pipelined models evaluate through
``model.eval_step`` (the schedule's forward only); others through ``model(**batch).loss`` under ``no_grad``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

import oslo_models as om


class Evaluator:
    """``evaluator(model) -> {"loss", "perplexity", "samples"}``; collective: call on every rank.

    ``make_collator()`` is called for every evaluation, so a random collator (MLM masking, T5 span corruption)
    seeded the same way corrupts the held-out set identically each time and the numbers are comparable.
    ``prefix``: a token file's prefix, read as windows of ``sample_len`` tokens; or a dataset of samples for
    ``make_collator()`` (train_sft.py's prompt/response pairs).
    """

    def __init__(self, prefix, sample_len: int, make_collator: Callable, *, batch_size: int,
                 max_samples: int, context):
        if isinstance(prefix, str):
            dataset = om.data.PackedCausalLMDataset(prefix, sample_len, shuffle=False, num_epochs=1)
            what = f"--eval-data {prefix} has {len(dataset)} windows of {sample_len} tokens"
        else:
            dataset, what = prefix, f"the held-out set has {len(prefix)} samples"
        per_step = batch_size * context.dp_size
        usable = min(len(dataset), max_samples) // per_step * per_step
        if usable == 0:
            raise ValueError(f"{what}, fewer than one evaluation batch ({batch_size} per rank x {context.dp_size} "
                             f"data-parallel ranks)")
        self.dataset = torch.utils.data.Subset(dataset, range(usable))
        self.make_collator, self.batch_size, self.context = make_collator, batch_size, context

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        loader = om.data.build_dataloader(self.dataset, self.batch_size, self.make_collator(),
                                          parallel_context=self.context, shuffle=False, drop_last=True)
        pipelined = self.context.pp_size > 1
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64)
        batches = 0
        for batch in loader:
            batch = {k: v.to(self.context.device) for k, v in batch.items()}
            # eval_step returns the dp mean on every rank; forward the local batch's mean
            loss = model.eval_step(batch) if pipelined else model(**batch).loss
            total += loss.detach().double().cpu()
            batches += 1
        model.train(was_training)
        mean = total / batches
        if not pipelined and self.context.world_size > 1:
            # tp ranks hold equal values, so the mean over the world is the mean over dp ranks
            mean = mean.to(self.context.device, torch.float32)
            torch.distributed.all_reduce(mean)
            mean = mean.double().cpu() / self.context.world_size
        loss = float(mean)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "samples": len(self.dataset)}


def evaluator_for(args, context, eval_prefix: str | None, sample_len: int, make_collator: Callable):
    """An :class:`Evaluator` for ``--eval-data`` or ``None``."""
    if eval_prefix is None:
        return None
    return Evaluator(eval_prefix, sample_len, make_collator, batch_size=args.batch_size,
                     max_samples=args.eval_samples, context=context)

