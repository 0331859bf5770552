"""Knowledge distillation of a causal LM at any tensor x data layout: a forward or reverse KL to a teacher mixed with
the language-model loss, on vocabulary-parallel logits (``om.post_training.distill_objective``).

    torchrun --nproc_per_node 4 examples/distill.py --teacher path/to/big --tp 2 --teacher-tp 4 --top-k 64
    torchrun --nproc_per_node 4 examples/distill.py --teacher path/to/big --tp 2 --zero 3 --kd-direction reverse
    ... examples/distill.py --alpha 1.0 --kd-temperature 2.0        # KL only, softened distributions
    python examples/distill.py --config run.yaml                    # any option below as a YAML key

The student is train_clm.py's model (``--model``, ``--model-type`` or the default small GPT-2) on train_clm.py's
corpus and tokenizer. The teacher (``--teacher``, a checkpoint with the same vocabulary, e.g. one train_clm.py
wrote; without it a wider random GPT-2, ``--teacher-n-layer``/``--teacher-n-embd``, stands in: a smoke run) is
frozen at its own layout (``--teacher-tp``). With its logits split like the student's (the same tp size and
vocabulary) the KL runs over the whole vocabulary; otherwise, or with ``--top-k K``, against the teacher's top-K
logits computed at its layout. The loss is ``alpha * KL + (1 - alpha) * CE``, the token mean over the global batch.
Pipeline and context parallelism are refused.

Writes to ``--output``: ``loss.json``, ``loss.png`` (with matplotlib) and ``model/`` (the student, a Hub folder).
"""
from __future__ import annotations

import argparse

import oslo_models as om
from _common import UsageError, build_parser, check_launch, finish, make_accelerator, run
from _common import parse_args as _parse_args
from _post_training import add_frozen_options, check_layout, frozen, frozen_context, train
from oslo_models.training.global_batch import global_share
from train_clm import build_model, gpt2_config, prepare_data


def make_parser():
    parser = build_parser(__doc__, output="distill_out",
                          model_help="Hub id or folder of the student (default: a small GPT-2 from config)")
    add = parser.add_argument
    add("--teacher", help="Hub id or folder of the teacher (same vocabulary); default: a wider random GPT-2")
    add("--teacher-n-layer", type=int, default=None, help="layers of the stand-in teacher (default: 2 x --n-layer)")
    add("--teacher-n-embd", type=int, default=None, help="hidden size of the stand-in teacher (default: 2 x --n-embd)")
    add("--alpha", type=float, default=0.5, help="weight of the KL (1 - alpha: the language-model loss)")
    add("--kd-direction", default="forward", choices=["forward", "reverse"],
        help="forward: KL(teacher || student); reverse: KL(student || teacher)")
    add("--kd-temperature", type=float, default=1.0, help="softens both distributions in the KL")
    add("--top-k", type=int, default=None, help="distill from the teacher's top-k logits (needed when its logits "
                                                 "are split otherwise than the student's)")
    add_frozen_options(parser, "teacher")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def build_teacher(args, tokenizer, context):
    """``--teacher`` at ``context``, or the wider stand-in GPT-2 (seed ``--seed + 1``)."""
    if args.teacher:
        teacher = om.AutoModelForCausalLM.from_pretrained(args.teacher, parallel=context, progress=False)
        if teacher.config.vocab_size != len(tokenizer) and not args.model:
            raise UsageError(f"--teacher embeds {teacher.config.vocab_size} tokens, the tokenizer has "
                             f"{len(tokenizer)}: pass the teacher's --tokenizer")
        return frozen(teacher)
    wider = argparse.Namespace(**vars(args))
    wider.n_layer = args.teacher_n_layer or 2 * args.n_layer
    wider.n_embd = args.teacher_n_embd or 2 * args.n_embd
    wider.seed, wider.model, wider.model_type = args.seed + 1, None, None
    return frozen(build_model(wider, tokenizer, context))


def batches(args, prefix: str, tokenizer, context):
    """``next_batch(step, model)``: this replica's packed windows, with its share of the global label count."""
    global_batch = args.batch_size * context.dp_size
    dataset = om.data.PackedCausalLMDataset(prefix, args.seq_len, seed=args.seed, num_samples=args.steps * global_batch)
    loader = iter(om.data.build_dataloader(dataset, args.batch_size, om.data.CausalLMCollator(tokenizer),
                                           parallel_context=context, seed=args.seed))

    def next_batch(step: int, model) -> dict:
        batch = next(loader)
        batch["num_items_in_batch"] = global_share((batch["labels"][:, 1:] != -100).sum(), context)
        return batch

    return next_batch


def main(argv=None) -> None:
    args = parse_args(argv)
    check_layout(args)
    if not 0.0 <= args.alpha <= 1.0:
        raise UsageError(f"--alpha must be in [0, 1], got {args.alpha}")
    cfg = check_launch(args, om.AutoModelForCausalLM, gpt2_config)
    accelerator, context = make_accelerator(args, cfg)
    prefix, _, tokenizer = prepare_data(args, context)
    model = build_model(args, tokenizer, context)
    teacher = build_teacher(args, tokenizer, frozen_context(args, context, "teacher"))
    top_k = args.top_k
    if top_k is None and (teacher.parallel_context.tp_size != context.tp_size
                          or teacher.config.vocab_size != model.config.vocab_size):
        raise UsageError("the teacher's logits are split otherwise than the student's (--teacher-tp or its "
                         "vocabulary differs): pass --top-k K to distill from its top-K logits")
    train(args, accelerator, context, model, batches(args, prefix, tokenizer, context),
          om.post_training.distill_objective,
          f"distillation ({args.kd_direction} KL{f', top-{top_k}' if top_k else ''}, alpha {args.alpha})", tokenizer,
          teacher=teacher, top_k=top_k, alpha=args.alpha, direction=args.kd_direction,
          temperature=args.kd_temperature)
    finish(accelerator)


if __name__ == "__main__":
    run(main)
