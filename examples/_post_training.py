"""Pieces shared by examples/train_dpo.py, train_grpo.py and distill.py: their options, the layout checks, a frozen
copy of a model at its own layout, and the loop over ``om.post_training.train_step``. Corpus, tokenizer and the
small models come from train_clm.py (``prepare_data``, ``build_model``); the CLI, the accelerator and the export
from ``_common.py``. Not a public API."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

import oslo_models as om
from _common import UsageError, export, optimizer_and_scheduler
from _report import Reporter
from oslo_models import training


def add_frozen_options(parser, role: str) -> None:
    """``--{role}-tp``: the frozen model's own tensor-parallel size (default: the trained model's)."""
    parser.add_argument(f"--{role}-tp", type=int, default=None, metavar="N",
                        help=f"tensor-parallel size of the frozen {role} (its own layout over the same processes; "
                             "default: --tp)")


def check_layout(args) -> None:
    """What the post-training objectives refuse, before anything is built (``UsageError`` on every rank alike)."""
    if args.pp > 1:
        raise UsageError("these scripts score and sample with the model's forward, which under the pipeline schedule "
                         "returns no logits; train a pipelined model with om.post_training.train_step in your own "
                         "loop (the objective runs as the last stage's loss), or use --pp 1")
    if args.cp > 1:
        raise UsageError("post-training runs whole sequences per rank (log-probabilities of each completion); "
                         "--cp is not supported here")
    if args.tp_mode != "1d":
        raise UsageError("the vocabulary-parallel post-training losses run on the 1D tensor-parallel head; use "
                         "--tp-mode 1d")
    if args.grad_accum != 1:
        raise UsageError("these examples take one batch per optimizer step: use --batch-size, not --grad-accum")
    unsupported = [flag for flag, value in (("--resume", args.resume), ("--save-every", args.save_every),
                                            ("--stop-at", args.stop_at), ("--eval-data", args.eval_data),
                                            ("--async-save", getattr(args, "async_save", False))) if value]
    if unsupported:
        raise UsageError(f"{', '.join(unsupported)}: the post-training examples write the final model only (no "
                         "resumable checkpoints, no held-out evaluation)")


def frozen_context(args, context, role: str):
    """The frozen model's ``ParallelContext``: ``--{role}-tp`` over the same processes (the trained model's own
    context when it is the same size)."""
    tp = getattr(args, f"{role}_tp") or args.tp
    if tp == context.tp_size:
        return context
    try:
        return om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=tp))
    except ValueError as error:
        raise UsageError(f"--{role}-tp {tp}: {error}") from None


def no_dropout(model):
    """``model`` with every dropout at ``p = 0`` (TRL's ``disable_dropout`` default): the policy and its frozen copy
    then score a sequence alike at the first step."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def frozen(model):
    """``model`` in eval mode with no parameter requiring a gradient."""
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()


def train(args, accelerator, context, model, next_batch, objective, title: str, tokenizer, **options):
    """``args.steps`` of ``train_step(model, optimizer, objective, next_batch(step, model), **options)`` after
    ``training.prepare`` (ZeRO ``--zero`` over dp); logs the global loss and the objective's scalar metrics, then
    exports the Hub folder and ``loss.json``. Returns ``(model, losses)``."""
    no_dropout(model)
    optimizer, scheduler = optimizer_and_scheduler(args, model)
    model, optimizer, scheduler = training.prepare(accelerator, model, optimizer, scheduler, zero_stage=args.zero,
                                                   cpu_offload=args.cpu_offload)
    accelerator.print(f"{context}; zero_stage={args.zero}; {title}")
    reporter = Reporter(args, accelerator)
    losses = []
    progress = tqdm(total=args.steps, desc=title, disable=not accelerator.is_main_process, mininterval=1.0)
    for step in range(1, args.steps + 1):
        batch = {key: value.to(accelerator.device) if torch.is_tensor(value) else value
                 for key, value in next_batch(step, model).items()}
        loss, metrics = om.post_training.train_step(model, optimizer, objective, batch, accelerator=accelerator,
                                                    max_grad_norm=args.max_grad_norm or None, **options)
        scheduler.step()
        losses.append(loss.item())
        scalars = {f"train/{key}": float(value) for key, value in metrics.items()
                   if torch.is_tensor(value) and value.numel() == 1}
        reporter.log({"train/loss": losses[-1], **scalars}, step)
        progress.update(1)
        progress.set_postfix(loss=f"{losses[-1]:.4f}")
        if accelerator.is_main_process and (step % max(1, args.steps // 10) == 0 or step == 1):
            shown = "  ".join(f"{key[6:]} {value:.4f}" for key, value in scalars.items())
            progress.write(f"step {step:5d}  loss {losses[-1]:.4f}  {shown}")
    progress.close()
    export(args, accelerator, model, tokenizer, losses, title, reporter)
    return model, losses
