"""Pieces shared by examples/train_clm.py, train_mlm.py and train_seq2seq.py: CLI, data, the Accelerate loop, export.

Not a public API: each script imports what it needs (``from _common import ...``; the scripts' folder is on
``sys.path`` when they run).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch
import transformers
from tqdm.auto import tqdm

import oslo_models as om
from oslo_models import training

HERE = os.path.dirname(os.path.abspath(__file__))
BUILTIN_CORPUS = os.path.join(HERE, "data", "public_domain.txt")


def build_parser(description: str, *, output: str, model_help: str, lr: float = 3e-3,
                 vocab_help: str = "BPE size when training a tokenizer") -> argparse.ArgumentParser:
    """The options every example takes; a script adds its own before :func:`parse_args`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help="YAML file with any of the options below")
    parser.add_argument("--model", help=model_help)
    parser.add_argument("--data", help="corpus prefix (.bin/.idx) or a text/jsonl file; default: built-in corpus")
    parser.add_argument("--output", default=output)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (GPT-2, BERT, T5 only)")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches per step")
    parser.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b or zero_bubble")
    parser.add_argument("--virtual-stages", type=int, default=1, help="stages per rank (interleaved schedules)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over dp")
    parser.add_argument("--cpu-offload", action="store_true", help="ZeRO 2/3: params/grads/optimizer on CPU")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true", help="GPU only (loss scaling)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per data-parallel rank")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=512, help=vocab_help)
    parser.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT/checkpoint")
    parser.add_argument("--stop-at", type=int, default=0,
                        help="end this run (checkpointed) at this step, to --resume later (a time-limited job)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, letting ``--config run.yaml`` set defaults (flags on the command line still win)."""
    args = parser.parse_args(argv)
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        known = vars(args)
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in known or key == "config":
                raise ValueError(f"unknown option {key!r} in {args.config}")
        # the YAML sets defaults; flags given on the command line still win
        parser.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
        args = parser.parse_args(argv)
    if args.bf16 and args.fp16:
        raise ValueError("choose one of --bf16 and --fp16")
    return args


def prepare_data(args, context, train_tokenizer) -> tuple[str, transformers.PreTrainedTokenizerBase]:
    """Tokenizer and corpus prefix; rank 0 builds what is missing while the others wait.

    ``train_tokenizer(text_file, folder, vocab_size)`` writes a tokenizer folder when there is no ``--model``.
    """
    data = args.data or BUILTIN_CORPUS
    tokenizer_dir = args.model or os.path.join(args.output, "tokenizer")
    is_prefix = os.path.isfile(str(data) + ".idx")
    prefix = data if is_prefix else os.path.join(args.output, "corpus")
    if context.is_main_process:
        os.makedirs(args.output, exist_ok=True)
        if args.model is None and not os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
            if is_prefix:
                raise ValueError("--data is a token file: pass --model for its tokenizer")
            train_tokenizer(data, tokenizer_dir, args.vocab_size)
        if not is_prefix and not os.path.isfile(prefix + ".idx"):
            om.data.preprocess(data, prefix, tokenizer_dir, show_progress=False)
    context.barrier()
    return prefix, transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def make_accelerator(args):
    """``(accelerator, parallel context, mixed-precision mode)`` from the common options."""
    from accelerate import Accelerator

    mixed = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    # cpu=True on a machine without GPUs: torchrun ranks would otherwise each run alone (DistributedType.NO).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed,
                              gradient_accumulation_steps=args.grad_accum)
    cfg = om.ParallelConfig(tensor_parallel_size=args.tp, sequence_parallel=args.sequence_parallel,
                            zero_stage=args.zero, pipeline_parallel_size=args.pp, num_microbatches=args.microbatches,
                            pipeline_schedule=args.schedule, virtual_pipeline_size=args.virtual_stages)
    context = om.ParallelContext.from_config(cfg)  # reuses the process group Accelerate started
    return accelerator, context, mixed


def optimizer_and_scheduler(args, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    return optimizer, scheduler


def plot_losses(losses: list[float], path: str, title: str = "train_clm.py") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_loop(args, accelerator, model, optimizer, loader, scheduler) -> tuple[int, list[float]]:
    """Run (or resume) ``args.steps`` optimizer steps; checkpoint to ``OUTPUT/checkpoint``. Returns
    ``(step, losses)`` with one dp-mean loss per optimizer step."""
    checkpoint_dir = os.path.join(args.output, "checkpoint")
    step, losses = 0, []
    if args.resume:
        # A folder that exists but holds no complete checkpoint is an error (load_checkpoint raises on every rank):
        # starting fresh there would overwrite what a crash left. Only a run that never saved starts fresh.
        if not os.path.exists(checkpoint_dir):
            accelerator.print(f"WARNING: --resume: no checkpoint at {checkpoint_dir} yet; STARTING FRESH at step 0")
        else:
            info = training.load_checkpoint(checkpoint_dir, model, optimizer, scheduler, dataloader=loader,
                                            scaler=accelerator.scaler)
            step, losses = info["step"], list(info["extra"].get("losses", []))
            accelerator.print(f"resumed at step {step} from {info['path']} (saved at {info['layout']})")

    def save(step_now: int) -> None:
        training.save_checkpoint(checkpoint_dir, model, optimizer, scheduler, dataloader=loader,
                                 scaler=accelerator.scaler, step=step_now, extra={"losses": losses})

    pipelined = training.unwrap_model(model).parallel_context.pp_size > 1
    progress = tqdm(total=args.steps, initial=step, desc="training", disable=not accelerator.is_main_process,
                    mininterval=1.0)
    running = torch.zeros((), device=accelerator.device)
    last = min(args.steps, args.stop_at) if args.stop_at else args.steps
    # Stop right after the last step, not after fetching one more batch: the checkpoint records the loader's
    # position, and a batch fetched but not trained on would be skipped on resume.
    for batch in (loader if step < last else ()):
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.accumulate(model):
            if pipelined:  # the schedule runs forward and backward of every microbatch; loss on every rank
                loss = model.train_step(batch)
            else:
                loss = model(**batch).loss
                accelerator.backward(loss)
            running += loss.detach() / args.grad_accum
            if accelerator.sync_gradients and args.max_grad_norm > 0:
                training.clip_grad_norm_(model, args.max_grad_norm, accelerator=accelerator)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if not accelerator.sync_gradients:
            continue
        # tp ranks hold the same loss and dp ranks different ones: the mean over the world is the dp mean.
        mean = accelerator.reduce(running, reduction="mean").item()
        running.zero_()
        step += 1
        losses.append(mean)
        progress.update(1)
        progress.set_postfix(loss=f"{mean:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        if accelerator.is_main_process and (step % max(1, args.steps // 10) == 0 or step == 1):
            progress.write(f"step {step:5d}  loss {mean:.4f}")
        if args.save_every and step % args.save_every == 0:
            save(step)
        if step >= last:
            break
    progress.close()
    if not math.isfinite(losses[-1] if losses else 0.0):
        raise RuntimeError("the loss is not finite")
    save(step)
    return step, losses


def fit(args, accelerator, context, mixed: str, model, dataset, collator, tokens: str):
    """Loader, optimizer and scheduler, ``training.prepare``, then :func:`train_loop`: the part every example
    shares. ``tokens`` describes one sample for the start-up line. Returns ``(model, step, losses)``."""
    loader = om.data.build_dataloader(dataset, args.batch_size, collator, parallel_context=context, seed=args.seed)
    optimizer, scheduler = optimizer_and_scheduler(args, model)
    model, optimizer, loader, scheduler = training.prepare(accelerator, model, optimizer, loader, scheduler,
                                                           zero_stage=args.zero, cpu_offload=args.cpu_offload)
    global_batch = args.batch_size * args.grad_accum * context.dp_size
    accelerator.print(f"{context}; zero_stage={args.zero}; mixed_precision={mixed}; global batch {global_batch} "
                      f"x {tokens}; {len(dataset)} samples")
    step, losses = train_loop(args, accelerator, model, optimizer, loader, scheduler)
    return model, step, losses


def export(args, accelerator, model, tokenizer, losses: list[float], title: str) -> str:
    """Hub folder ``OUTPUT/model`` (every rank takes part), and on rank 0 the tokenizer, ``loss.png`` and
    ``loss.json``. Returns the folder."""
    model_dir = os.path.join(args.output, "model")
    training.save_pretrained(model, model_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(model_dir)
        plot_losses(losses, os.path.join(args.output, "loss.png"), title)
        with open(os.path.join(args.output, "loss.json"), "w", encoding="utf-8") as handle:
            json.dump({"losses": losses, "args": vars(args)}, handle, indent=1)
    return model_dir


def finish(accelerator) -> None:
    """End the run on every rank together and tear the process groups down before the interpreter exits (gloo
    groups left to interpreter teardown can abort a rank with "terminate called without an active exception")."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
