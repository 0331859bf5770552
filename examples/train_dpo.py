"""Direct Preference Optimization of a causal LM at any tensor x data layout, with vocabulary-parallel
log-probabilities (``om.post_training.dpo_objective``): no rank ever gathers the ``[tokens, vocab]`` logits.

    torchrun --nproc_per_node 4 examples/train_dpo.py --tp 2 --zero 3                 # CPU or GPU
    accelerate launch --num_processes 4 examples/train_dpo.py --model path/to/llama --tp 2 --ref-tp 4
    ... examples/train_dpo.py --loss-type ipo --beta 0.5          # IPO; sigmoid_norm: length-normalized DPO
    python examples/train_dpo.py --config run.yaml                # any option below as a YAML key

The preference pairs are built from the corpus (``--data``, default the built-in public-domain text): each pair is
a window's first ``--prompt-len`` tokens, its true continuation (chosen) and the continuation of another window
(rejected), so the task is "prefer the text that follows". The reference is the starting model, frozen, at its own
layout (``--ref-tp``, default ``--tp``). ``--model``/``--model-type``/the default small GPT-2, the tokenizer and the
corpus are train_clm.py's. Pipeline and context parallelism are refused (the objective needs each sequence's
log-probability at one rank); ZeRO 1-3 over dp and sequence parallelism apply. Dropout is off (TRL's default), so
the first step's loss is log 2.

Writes to ``--output``: ``loss.json``, ``loss.png`` (with matplotlib) and ``model/``, a Hub folder.
"""
from __future__ import annotations

import torch

import oslo_models as om
from _common import build_parser, check_launch, finish, make_accelerator, run
from _common import parse_args as _parse_args
from _post_training import add_frozen_options, check_layout, frozen, frozen_context, train
from train_clm import build_model, gpt2_config, prepare_data


def make_parser():
    parser = build_parser(__doc__, output="train_dpo_out", lr=1e-4,
                          model_help="Hub id or folder of the causal LM to align (default: a small GPT-2 from "
                                     "config, the same at every layout)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta (IPO's tau)")
    parser.add_argument("--loss-type", default="sigmoid", choices=om.post_training.dpo.LOSS_TYPES,
                        help="sigmoid (DPO), ipo, or sigmoid_norm (length-normalized DPO)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of each pair (of --seq-len)")
    add_frozen_options(parser, "ref")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def pair_batches(args, prefix: str, context):
    """``next_batch(step)``: this replica's ``--batch-size`` pairs of the step (chosen rows, then rejected)."""
    global_pairs = args.batch_size * context.dp_size
    windows = om.data.PackedCausalLMDataset(prefix, args.seq_len, seed=args.seed,
                                            num_samples=args.steps * global_pairs + 1)

    def next_batch(step: int, model) -> dict:
        first = (step - 1) * global_pairs + context.dp_rank * args.batch_size
        rows = [torch.as_tensor(windows[first + i]["input_ids"]) for i in range(args.batch_size + 1)]
        chosen = torch.stack(rows[:-1])
        rejected = torch.cat([chosen[:, :args.prompt_len], torch.stack(rows[1:])[:, args.prompt_len:]], dim=1)
        input_ids = torch.cat([chosen, rejected])
        completion = torch.zeros_like(input_ids)
        completion[:, args.prompt_len:] = 1
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "completion_mask": completion}

    return next_batch


def main(argv=None) -> None:
    args = parse_args(argv)
    check_layout(args)
    if not 0 < args.prompt_len < args.seq_len:
        from _common import UsageError

        raise UsageError(f"--prompt-len must be between 1 and --seq-len - 1 ({args.seq_len - 1})")
    cfg = check_launch(args, om.AutoModelForCausalLM, gpt2_config)
    accelerator, context = make_accelerator(args, cfg)
    prefix, _, tokenizer = prepare_data(args, context)
    model = build_model(args, tokenizer, context)
    reference = frozen(build_model(args, tokenizer, frozen_context(args, context, "ref")))
    train(args, accelerator, context, model, pair_batches(args, prefix, context), om.post_training.dpo_objective,
          f"DPO ({args.loss_type}, beta {args.beta})", tokenizer, reference=reference, beta=args.beta,
          loss_type=args.loss_type)
    finish(accelerator)


if __name__ == "__main__":
    run(main)
