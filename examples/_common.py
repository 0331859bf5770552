"""Pieces shared by examples/train_clm.py, train_mlm.py and train_seq2seq.py: CLI, launch checks, the Accelerate
loop, export. Corpus and tokenizer: ``_data.py``.

Not a public API: each script imports what it needs (``from _common import ...``; the scripts' folder is on
``sys.path`` when they run). Evaluation is in ``_evaluate.py``; loss file, plot, trackers and Hub upload in
``_report.py``.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

import torch
import transformers
from tqdm.auto import tqdm

import oslo_models as om
from _evaluate import Evaluator
from _report import Reporter, check_trackers, export_files, trackers
from oslo_models import training
from oslo_models.cli import HelpFormatter
from oslo_models.generic import is_generic
from oslo_models.training.layout_rules import check_training_layout

HERE = os.path.dirname(os.path.abspath(__file__))


class UsageError(ValueError):
    """A wrong option or launch: every rank finds it alike, rank 0 prints one line, all exit with status 2."""


def build_parser(doc: str, *, output: str, model_help: str, lr: float = 3e-3,
                 vocab_help: str = "BPE size when training a tokenizer") -> argparse.ArgumentParser:
    """The options every example takes; a script adds its own before :func:`parse_args`. ``doc``: the script's
    docstring, shown whole by ``--help`` (it holds the launch examples)."""
    # allow_abbrev=False: a prefix is never taken for another option (``--cp 2`` is not ``--cpu-offload 2``)
    parser = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter, allow_abbrev=False)
    add = parser.add_argument
    add("--config", help="YAML file with any of the options below as keys (dashes or underscores)")
    add("--parallel-config", metavar="JSON", help="a ParallelConfig JSON (e.g. `python -m oslo_models plan --json "
                                                  "plan.json`): sets --tp, --pp, --cp, --zero, ... (flags given on "
                                                  "the command line still win)")
    add("--plan", choices=["auto"], help="choose the layout (--tp, --pp, --zero, ...) and the batch split at launch "
        "with the planner, for this world (needs --global-batch-size; see examples/_plan.py)")
    add("--global-batch-size", type=int, metavar="N", help="sequences per optimizer step: sets --batch-size and "
        "--grad-accum from the layout's data-parallel size (and pipeline microbatches)")
    add("--memory-per-device", help="--plan auto's memory cap per process, e.g. 16GB (default: the GPU's, or host "
        "RAM / local processes)")
    add("--model", help=model_help)
    add("--model-type", help="build a small random model of this transformers model type (any: 'mamba', "
                             "'granite', ...; a type without a native family trains on the generic path), sized by "
                             "--n-layer / --n-embd / --n-head")
    add("--tokenizer", help="tokenizer folder or Hub id; default: --model's, or one trained on --data")
    add("--data", help="corpus prefix (.bin/.idx) or a text/jsonl file; default: the built-in corpus")
    add("--text-field", default="text", help="the field holding the text in a jsonl --data / --eval-data")
    add("--eval-data", help="held-out corpus (prefix or text/jsonl file): loss and perplexity at --eval-every")
    add("--eval-every", type=int, default=0, help="evaluate every N optimizer steps (0: only at the end)")
    add("--eval-samples", type=int, default=256, help="at most this many held-out windows per evaluation")
    add("--output", default=output, help="folder for checkpoint/, model/, loss.json, loss.png")
    add("--tp", type=int, default=1, help="tensor-parallel size")
    add("--sequence-parallel", action="store_true", help="Megatron sequence parallelism inside tp")
    add("--tp-mode", default="1d", choices=["1d", "2d", "2.5d", "3d"], help="tensor-parallel layout (grid modes: "
        "--tp is the grid's size, 4 for 2d, q*q*depth for 2.5d, 8 for 3d)")
    add("--tp-depth", type=int, default=1, help="2.5d grid depth")
    add("--cp", type=int, default=1, help="context-parallel size (the sequence split over ranks)")
    add("--cp-mode", default="ring", choices=["ring", "all_to_all"], help="context-parallel attention")
    add("--ep", type=int, default=1, help="expert-parallel size (mixture-of-experts models)")
    add("--pp", type=int, default=1, help="pipeline stages")
    add("--microbatches", type=int, default=None, help="pipeline microbatches per step (default: pp)")
    add("--schedule", default="1f1b", help="gpipe, 1f1b, interleaved_1f1b or zero_bubble")
    add("--virtual-stages", type=int, default=1, help="stages per rank (interleaved_1f1b, zero_bubble)")
    add("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage over the data-parallel group")
    add("--offload", choices=["cpu", "nvme"], default=None,
        help="cpu: ZeRO 2/3 params/grads/optimizer in host memory; nvme: the Adam state on disk (--offload-path)")
    add("--offload-path", default=None, help="--offload nvme: a folder on a local disk (each rank uses rank<N>/)")
    add("--cpu-offload", action="store_true", help="same as --offload cpu")
    add("--dp-shard", type=int, default=None, metavar="K",
        help="HSDP with --zero 2/3: shard over groups of K data-parallel ranks, replicate across the groups")
    add("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
        help="overrides `accelerate launch --mixed_precision` and the accelerate config file (default: theirs)")
    add("--bf16", action="store_true", help="same as --mixed-precision bf16")
    add("--fp16", action="store_true", help="same as --mixed-precision fp16 (GPU only: loss scaling)")
    add("--steps", type=int, default=200, help="optimizer steps")
    add("--seq-len", type=int, default=64, help="tokens per sample")
    add("--batch-size", type=int, default=8, help="micro-batch per data-parallel rank")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("--lr", type=float, default=lr, help="peak learning rate (AdamW)")
    add("--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay")
    add("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    add("--activation-checkpointing", metavar="MODE", default=None, choices=["full", "selective", "offload", "partitioned"],
        help="recompute activations in backward: full blocks, selective (the attention core only), offload (block "
             "inputs in host memory) or partitioned (each tp rank keeps 1/tp of a block's input)")
    add("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
        help="torch.compile the model through Accelerate (default backend: inductor)")
    add("--n-layer", type=int, default=2, help="layers of a model built from config")
    add("--n-embd", type=int, default=128, help="hidden size of a model built from config")
    add("--n-head", type=int, default=4, help="attention heads of a model built from config")
    add("--vocab-size", type=int, default=512, help=vocab_help)
    add("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    add("--keep-checkpoints", type=int, default=2,
        help="newest step folders kept in OUTPUT/checkpoint (2: a corrupt newest one falls back to the previous)")
    add("--async-save", action="store_true",
        help="write checkpoints from a background thread while training goes on (state staged in host memory, "
             "pinned on CUDA; one save in flight; 'latest' moves when the write is complete)")
    add("--resume", action="store_true",
        help="continue from OUTPUT/checkpoint (automatic after an elastic restart: torchrun --max-restarts)")
    add("--collective-timeout", type=float, default=600.0,
        help="seconds a rank waits in a collective for a stopped or dead peer before every rank fails with an "
             "error naming the group, the operation and the missing ranks (0: the backend's own timeout); raise it "
             "when rank 0 alone tokenizes a large --data for longer")
    add("--stop-at", type=int, default=0,
        help="end this run (checkpointed) at this step, to --resume later (a time-limited job)")
    add("--report-to", default="none",
        help="comma-separated Accelerate trackers (tensorboard, wandb, mlflow, ..., all) and/or 'jsonl' "
             "(OUTPUT/metrics.jsonl, needs nothing installed)")
    add("--push-to-hub", metavar="REPO_ID", help="upload the final Hub folder (model + tokenizer) to this repo")
    add("--seed", type=int, default=0, help="weights, data order and masking")
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, letting ``--config run.yaml`` set defaults (flags on the command line still win)."""
    args = parser.parse_args(argv)
    if args.config:
        import yaml

        with open(args.config, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        known = vars(args)
        for key in values:
            if key.replace("-", "_") not in known or key == "config":
                parser.error(f"unknown option {key!r} in {args.config}")
        # the YAML sets defaults; flags given on the command line still win
        parser.set_defaults(**{k.replace("-", "_"): v for k, v in values.items()})
        args = parser.parse_args(argv)
    if args.parallel_config:
        parser.set_defaults(**parallel_config_options(args.parallel_config, parser))
        args = parser.parse_args(argv)
    flags = [name for name in ("bf16", "fp16") if getattr(args, name)]
    if len(flags) > 1 or (flags and args.mixed_precision not in (None, flags[0])):
        parser.error("choose one of --bf16, --fp16 and --mixed-precision")
    if flags:
        args.mixed_precision = flags[0]
    from _plan import check_options

    check_options(args, parser)
    return args


# ParallelConfig field -> the example option that sets it
_PARALLEL_OPTIONS = {"tensor_parallel_size": "tp", "sequence_parallel": "sequence_parallel",
                     "tensor_parallel_mode": "tp_mode", "tensor_parallel_depth": "tp_depth",
                     "context_parallel_size": "cp", "context_parallel_mode": "cp_mode", "expert_parallel_size": "ep",
                     "pipeline_parallel_size": "pp", "num_microbatches": "microbatches",
                     "pipeline_schedule": "schedule", "virtual_pipeline_size": "virtual_stages", "zero_stage": "zero",
                     "data_parallel_shard_size": "dp_shard", "activation_checkpointing": "activation_checkpointing",
                     "collective_timeout": "collective_timeout", "offload": "offload",
                     "offload_path": "offload_path"}


def parallel_config_options(path: str, parser: argparse.ArgumentParser) -> dict:
    """The example options a ParallelConfig JSON stands for; ``parser.error`` for a field no option sets (at a
    value other than its default) or a file ``ParallelConfig.from_json`` refuses. ``data_parallel_size`` is
    checked against the launched world by ``check_launch``, like the options."""
    try:
        cfg = om.ParallelConfig.from_json(path)
    except (ValueError, NotImplementedError, FileNotFoundError) as error:
        parser.error(f"--parallel-config {path}: {error}")
    default, values = om.ParallelConfig(), cfg.to_dict()
    unsupported = [key for key, value in values.items() if key not in _PARALLEL_OPTIONS
                   and key not in ("data_parallel_size", "seed", "fused_ops") and value != getattr(default, key)]
    if unsupported:
        parser.error(f"--parallel-config {path}: the examples have no option for {unsupported}")
    options = {option: values[key] for key, option in _PARALLEL_OPTIONS.items()}
    options["collective_timeout"] = options["collective_timeout"] or 0.0
    return options


def small_config(args, vocab_size: int, **overrides):
    """``--model-type``: the config of a small model of that type (``transformers``' own config class). The sizes
    are set through the common names, which every config maps to its own (``hidden_size`` is GPT-2's ``n_embd``);
    a name a type does not use is kept as an unused attribute."""
    sizes = dict(vocab_size=vocab_size, hidden_size=args.n_embd, num_hidden_layers=args.n_layer,
                 num_attention_heads=args.n_head, num_key_value_heads=args.n_head, intermediate_size=4 * args.n_embd,
                 max_position_embeddings=max(64, args.seq_len))
    try:
        return transformers.AutoConfig.for_model(args.model_type, **{**sizes, **overrides})
    except Exception as error:  # noqa: BLE001 - unknown type, or sizes the config's own validation refuses
        raise UsageError(f"--model-type {args.model_type!r}: {error}") from None


def check_model(args, cfg: om.ParallelConfig, auto) -> None:
    """The model against the layout, before any process group: a type neither this project nor ``transformers``
    has for the script's task, or a layout the model's path refuses (e.g. ``--tp 2`` for a type without a
    tensor-parallel plan), is one clean ``UsageError``."""
    if args.model and args.model_type:
        raise UsageError("pass --model (a checkpoint) or --model-type (a new small model), not both")
    if not (args.model or args.model_type):
        return
    try:
        config = (transformers.AutoConfig.from_pretrained(args.model) if args.model
                  else small_config(args, args.vocab_size))
        model_class = auto.model_class_for(config)
        if hasattr(model_class, "parallel_plan"):  # a native family
            from oslo_models.composition import check_model_layout

            check_model_layout(model_class, config, cfg)
        else:
            from oslo_models.generic.support import check_parallel

            check_parallel(config, cfg, model_class)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(str(error)) from None


def check_launch(args, auto=None, default_config=None) -> om.ParallelConfig:
    """Everything about the launch that can be wrong, from the options and the launcher's environment alone (no
    process group, no model): the world against tp x pp, pipeline limits, ZeRO options, and with ``auto`` (the
    script's Auto class) ``--model`` / ``--model-type`` against the layout. Raises ``UsageError``. First
    ``--plan auto`` / ``--global-batch-size`` set the layout and batch options (``_plan.py``; ``default_config(args,
    vocab_size)``: the script's model when neither ``--model`` nor ``--model-type`` is given)."""
    from _plan import apply_plan, split_global_batch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    mixed = args.mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if args.plan:
        apply_plan(args, auto, default_config, mixed)
    if args.cpu_offload:  # the older spelling of --offload cpu
        if args.offload == "nvme":
            raise UsageError("--cpu-offload is --offload cpu: it cannot be combined with --offload nvme")
        args.offload = "cpu"
    try:
        cfg = om.ParallelConfig(tensor_parallel_size=args.tp, sequence_parallel=args.sequence_parallel,
                                tensor_parallel_mode=args.tp_mode, tensor_parallel_depth=args.tp_depth,
                                context_parallel_size=args.cp, context_parallel_mode=args.cp_mode,
                                expert_parallel_size=args.ep, zero_stage=args.zero, pipeline_parallel_size=args.pp,
                                data_parallel_shard_size=args.dp_shard,
                                num_microbatches=args.microbatches, pipeline_schedule=args.schedule,
                                virtual_pipeline_size=args.virtual_stages,
                                activation_checkpointing=args.activation_checkpointing,
                                collective_timeout=args.collective_timeout or None, offload=args.offload,
                                offload_path=args.offload_path)
        dp = cfg.resolve_data_parallel_size(world)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(str(error)) from None
    if args.global_batch_size and not args.plan:
        split_global_batch(args, dp)
    for name in ("steps", "seq_len", "batch_size", "grad_accum", "keep_checkpoints"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    try:  # what training.prepare refuses (ZeRO stages, offload, precision, accumulation under pp)
        check_training_layout(cfg, cpu_offload=args.cpu_offload, mixed_precision=mixed,
                              gradient_accumulation_steps=args.grad_accum)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(str(error)) from None
    if args.pp > 1:
        microbatches = cfg.num_microbatches or args.pp  # the runner's default
        if args.batch_size % microbatches:
            raise UsageError(f"--batch-size {args.batch_size} does not split into --microbatches {microbatches}")
    if mixed == "fp16" and not torch.cuda.is_available():
        raise UsageError("fp16 needs a GPU (loss scaling); use bf16 on CPU")
    if args.compile:
        from accelerate.utils import DynamoBackend

        if args.compile.upper() not in DynamoBackend.__members__:
            raise UsageError(f"--compile {args.compile}: unknown backend; use one of "
                             f"{', '.join(b.lower() for b in DynamoBackend.__members__ if b != 'NO')}")
    if auto is not None:
        check_model(args, cfg, auto)
    problem = check_trackers(args)
    if problem:
        raise UsageError(problem)
    if args.zero and dp == 1:
        print_once(f"note: --zero {args.zero} with data-parallel size 1 shards nothing")
    return cfg


def print_once(message: str, file=None) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=file or sys.stderr, flush=True)


def run(main, argv=None) -> None:
    """Run ``main(argv)`` and end the process deterministically.

    A ``UsageError`` (raised alike on every rank) becomes one line from rank 0 and exit status 2 on every rank,
    instead of one traceback per rank. After ``main`` returns, its objects are freed while the interpreter is
    whole: the pipelined model and its runner refer to each other (a cycle only the garbage collector frees) and
    hold the pipeline and tied-embedding process groups; left to interpreter finalization, a gloo group's
    destructor there can hang or abort the rank ("terminate called without an active exception"). Then every rank
    meets at a barrier and the process groups are destroyed. Any other exception propagates untouched (a rank
    that fails must not wait for the others), and the launcher stops the job.
    """
    try:
        main(argv)
    except UsageError as error:
        print_once(f"{os.path.basename(sys.argv[0])}: error: {error}")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(2)
    except training.NonFiniteError as error:  # agreed on every rank: stop together, one message
        print_once(f"{os.path.basename(sys.argv[0])}: stopped: {error}")
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.exit(3)
    except RuntimeError as error:  # a collective that timed out: the watchdog's report names who is missing
        om.distributed.raise_for_timeout(error)
        raise
    teardown()


def teardown() -> None:
    """Free what is only held in reference cycles (the pipelined model and its runner, with their process
    groups), then barrier and destroy the process groups: all while the interpreter is whole. Every rank."""
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def make_accelerator(args, cfg: om.ParallelConfig):
    """``(accelerator, parallel context)``. Mixed precision: ``--mixed-precision`` when given, else what
    ``accelerate launch`` / the accelerate config file set (``None`` lets the Accelerator read them)."""
    from accelerate import Accelerator

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # before Accelerate would: the collective timeout, and a store prefix per elastic restart (see there)
        om.distributed.init_process_group_from_environment(timeout=cfg.collective_timeout and (
            cfg.collective_timeout + om.distributed.watchdog.grace_for(cfg.collective_timeout)))
    # cpu=True on a machine without GPUs: torchrun ranks would otherwise each run alone (DistributedType.NO).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.grad_accum, log_with=trackers(args) or None,
                              project_dir=args.output, dynamo_backend=args.compile.upper() if args.compile else None)
    context = om.ParallelContext.from_config(cfg)  # reuses the process group Accelerate started
    return accelerator, context


def optimizer_and_scheduler(args, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    return optimizer, scheduler


def elastic_restart(device="cpu") -> int:
    """How many times torchrun's elastic agents have restarted this job's workers (0: first attempt): the largest
    count of any rank (collective when a process group is up). With several nodes the counts can differ: an agent
    whose workers were still healthy when another node's failed restarts them as a membership change, which torchrun
    does not count (``TORCHELASTIC_RESTART_COUNT`` stays 0 there), and those ranks alone would start fresh."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        agreed = torch.tensor([count], device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX)
        count = int(agreed.item())
    return count


def resume(args, accelerator, model, optimizer, scheduler, loader) -> tuple[int, list[float]]:
    """``(step, losses)`` to start from: ``OUTPUT/checkpoint`` with ``--resume`` or after an elastic restart
    (``torchrun --max-restarts N`` relaunches the same command: the restarted workers resume by themselves), else
    ``(0, [])``. A corrupt newest checkpoint falls back to the previous one (loudly)."""
    checkpoint_dir = os.path.join(args.output, "checkpoint")
    restart = elastic_restart(accelerator.device)  # every rank alike (collective)
    if args.resume or restart:
        why = f"elastic restart #{restart}" if restart else "--resume"
        found = training.find_checkpoint(checkpoint_dir)
        # A folder that exists but holds no complete checkpoint is an error for --resume (load_checkpoint raises on
        # every rank): starting fresh there would overwrite what an earlier crash left. After an elastic restart it
        # is this job's own first save that was cut short, and the first attempt started fresh too.
        if not os.path.exists(checkpoint_dir) or (restart and found is None and not args.resume):
            accelerator.print(f"WARNING: {why}: no checkpoint at {checkpoint_dir} yet; STARTING FRESH at step 0")
        else:
            info = training.load_checkpoint(checkpoint_dir, model, optimizer, scheduler, dataloader=loader,
                                            scaler=accelerator.scaler, fallback=True)
            for folder, reason in info["skipped"]:
                accelerator.print(f"WARNING: SKIPPED the corrupt checkpoint {folder}: {reason}")
            accelerator.print(f"resumed at step {info['step']} from {info['path']} (saved at {info['layout']}; "
                              f"{why})")
            return info["step"], list(info["extra"].get("losses", []))
    return 0, []


def train_loop(args, accelerator, model, optimizer, loader, scheduler, reporter: Reporter,
               evaluator: Evaluator | None) -> tuple[int, list[float]]:
    """Run (or resume) ``args.steps`` optimizer steps; checkpoint to ``OUTPUT/checkpoint``; evaluate every
    ``--eval-every`` steps and at the end. Returns ``(step, losses)`` with one dp-mean loss per optimizer step."""
    checkpoint_dir = os.path.join(args.output, "checkpoint")
    step, losses = resume(args, accelerator, model, optimizer, scheduler, loader)

    def save(step_now: int) -> None:
        training.save_checkpoint(checkpoint_dir, model, optimizer, scheduler, dataloader=loader,
                                 scaler=accelerator.scaler, step=step_now, extra={"losses": losses},
                                 keep=args.keep_checkpoints, async_=args.async_save)

    pipelined = training.unwrap_model(model).parallel_context.pp_size > 1
    only_loss = {} if is_generic(model) else {"skip_logits": True}  # transformers' own classes: plain forward
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
                # only the loss is needed: a native head's fused, chunked loss never builds [tokens, vocab] logits
                loss = model(**batch, **only_loss).loss
                accelerator.backward(loss)
            running += loss.detach() / args.grad_accum
            if accelerator.sync_gradients:
                check_step(args, accelerator, model, running, step + 1, checkpoint_dir)
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
        lr = scheduler.get_last_lr()[0]
        progress.update(1)
        progress.set_postfix(loss=f"{mean:.3f}", lr=f"{lr:.2e}")
        reporter.log({"train/loss": mean, "train/lr": lr}, step)
        if accelerator.is_main_process and (step % max(1, args.steps // 10) == 0 or step == 1):
            progress.write(f"step {step:5d}  loss {mean:.4f}")
        if evaluator is not None and args.eval_every and step % args.eval_every == 0 and step < last:
            reporter.log_eval(evaluator(model), step, progress.write)
        if args.save_every and step % args.save_every == 0:
            save(step)
        if step >= last:
            break
    progress.close()
    if evaluator is not None:
        reporter.log_eval(evaluator(model), step, accelerator.print)
    save(step)
    training.wait_for_checkpoint(model)  # --async-save: the last checkpoint is on disk before the run goes on
    return step, losses


def check_step(args, accelerator, model, loss, step: int, checkpoint_dir: str) -> None:
    """Before ``optimizer.step()``: clip (``--max-grad-norm``) or just measure the global gradient norm, and decide
    on every rank together whether this rank's loss or the norm is NaN/inf (``training.find_nonfinite``). Under
    fp16 loss scaling the scaler skips the step on every rank (marked from the global norm) and training goes
    on; otherwise every rank raises ``NonFiniteError`` here, before the weights or a checkpoint see the values."""
    if args.max_grad_norm > 0:
        norm = training.clip_grad_norm_(model, args.max_grad_norm, accelerator=accelerator)
    else:
        if accelerator.scaler is not None:
            # the scaler holds its skip flags only once it has unscaled: unscale now (optimizer.step then does not
            # again) so that mark_overflow below reaches them, also on a rank whose own shard is finite
            accelerator.unscale_gradients()
        norm = training.grad_norm(model)
        if accelerator.scaler is not None and not torch.isfinite(norm):
            training.mark_overflow(accelerator.scaler)
    text = training.describe_nonfinite(training.find_nonfinite(model, loss=loss, grad_norm=norm), step=step)
    if text is None:
        return
    if accelerator.scaler is not None:
        accelerator.print(f"{text}: fp16 loss scaling skips this step on every rank (scale "
                          f"{accelerator.scaler.get_scale():g} is lowered)")
        return
    last = training.find_checkpoint(checkpoint_dir)
    raise training.NonFiniteError(f"{text}; stopped before the optimizer step, nothing saved over the last good "
                                  f"checkpoint ({last or 'none yet'}): resume from it with a lower --lr, or "
                                  "check the data")


def fit(args, accelerator, context, model, dataset, collator, tokens: str, evaluator: Evaluator | None = None,
        split_context: bool | None = None, **ddp_kwargs):
    """Loader, optimizer and scheduler, ``training.prepare``, then :func:`train_loop`: the part every example
    shares. ``tokens`` describes one sample for the start-up line; ``split_context``: ``build_dataloader``'s
    (``False``: the collator keeps the cp rank's part itself, as train_vlm.py's does); ``ddp_kwargs`` go to DDP at
    ZeRO-0 (e.g. ``find_unused_parameters``). Returns ``(model, step, losses, reporter)``."""
    loader = om.data.build_dataloader(dataset, args.batch_size, collator, parallel_context=context, seed=args.seed,
                                      split_context=split_context)
    optimizer, scheduler = optimizer_and_scheduler(args, model)
    if args.zero and context.dp_size > 1:
        # ZeRO builds a new (sharded) optimizer after the scheduler was made on the plain one, and prepare points
        # the scheduler at it; torch then warns once per rank that optimizer.step() "has been overridden after
        # learning rate scheduler initialization". The schedule is still applied to the optimizer that steps.
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")
        accelerator.print(f"note: --zero {args.zero} rebuilds the optimizer over the data-parallel group; the LR "
                          f"scheduler follows it (torch's 'optimizer.step() has been overridden' warning is "
                          f"silenced)")
    if args.zero >= 2 and context.dp_size > 1:
        # FSDP2 warns (once per rank) when the model returns a view (e.g. logits from a biased Linear over [b, s, h]):
        # an in-place op on it would skip a hook. This loop never modifies model outputs in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    model, optimizer, loader, scheduler = training.prepare(accelerator, model, optimizer, loader, scheduler,
                                                           zero_stage=args.zero, cpu_offload=args.cpu_offload,
                                                           **ddp_kwargs)
    global_batch = args.batch_size * args.grad_accum * context.dp_size
    accelerator.print(f"{context}; zero_stage={args.zero}; mixed_precision={accelerator.mixed_precision}; global "
                      f"batch {global_batch} x {tokens}; {len(dataset)} samples")
    reporter = Reporter(args, accelerator)
    step, losses = train_loop(args, accelerator, model, optimizer, loader, scheduler, reporter, evaluator)
    return model, step, losses, reporter


def export(args, accelerator, model, tokenizer, losses: list[float], title: str, reporter: Reporter) -> str:
    """Hub folder ``OUTPUT/model`` (every rank takes part: rank 0 writes), and on rank 0 the tokenizer,
    ``loss.json``, ``loss.png`` and the ``--push-to-hub`` upload. Returns the folder."""
    model_dir = os.path.join(args.output, "model")
    training.save_pretrained(model, model_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(model_dir)
        export_files(args, accelerator, losses, reporter, title, model_dir)
    return model_dir


def finish(accelerator) -> None:
    """End the run on every rank together (trackers closed). The process groups are torn down by :func:`run`
    once ``main`` has returned and its objects are freed."""
    accelerator.wait_for_everyone()
    accelerator.end_training()
