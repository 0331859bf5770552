"""Supervised fine-tuning of a causal LM (any transformers type: the native families and the generic path) on
(prompt, response) pairs, the loss on the responses only, with every layout train_clm.py takes.

    torchrun --nproc_per_node 2 examples/train_sft.py                     # a small Llama on the built-in tasks
    torchrun --nproc_per_node 2 examples/train_sft.py --pack --seq-len 128 --batch-size 16   # packed first-fit
    torchrun --nproc_per_node 4 examples/train_sft.py --pack --pp 2 --microbatches 2        # packed, pipelined
    torchrun --nproc_per_node 4 examples/train_sft.py --model path/to/qwen --tp 2 --zero 3 --data sft.jsonl
    ... examples/train_sft.py --model-type granite --pack --cp 2          # a generic-path type, long rows split
    ... examples/train_sft.py --pack --seq-len 4096 --tiled-mlp auto --tiled-loss --activation-offload

Samples: ``--data FILE.jsonl`` (one JSON object per line with ``--prompt-field`` and ``--response-field``, default
``prompt`` / ``response``; ``--eval-data`` the same format), or without it a built-in set generated in code from
each sample's index (sums, reversed word lists, word counts: nothing downloaded), with held-out samples from another
index range. A sample is ``"### Question: {prompt}\\n### Answer:"`` then ``" {response}"`` and the end-of-text token;
``om.data.SFTCollator`` masks the prompt from the loss (labels -100) and pads each batch (``--seq-len`` is the most
tokens a sample keeps). ``--pack``: the batch's samples packed first-fit into rows of ``--seq-len`` tokens, position
ids restarting per sample and attention within each sample (``cu_seqlens`` too, except under pipeline parallelism,
where the row count is padded with empty rows to a multiple of the microbatches): loss and gradients are those of
the padded batch. ``--batch-size`` counts samples either way, and the loss of a step is the global batch's (summed
over its response tokens / their number).

``--model`` takes a causal LM with its tokenizer; ``--model-type TYPE`` builds a small random model of any type;
without either a small Llama is built from config, with a byte-level BPE trained here on the samples' text. Writes
to ``--output``: ``checkpoint/`` (resumable), ``loss.json``, ``model/`` (a Hub folder plain ``transformers`` loads;
``--push-to-hub ID`` uploads it), and at the end rank 0 answers a held-out prompt with plain ``transformers``.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

import oslo_models as om
from _common import UsageError, build_parser, check_launch, export, finish, fit, make_accelerator, run, small_config
from _common import parse_args as _parse_args
from _data import check_tokenizer, tokenizer_source
from _evaluate import Evaluator
from train_clm import add_long_sequence_options, packing_options, train_tokenizer, with_long_sequence_options

WORDS = ("red green blue cat dog sun moon tree river stone bird fish star rain wind fire snow leaf road hill "
         "boat lamp door book").split()
HELD_OUT = 10 ** 6  # the built-in held-out samples' first index


def builtin_pair(index: int) -> tuple[str, str]:
    """The built-in set's sample ``index``: ``(prompt, response)``, drawn from the index alone (any rank, any run)."""
    rng = np.random.default_rng([7, index])
    task = index % 3
    if task == 0:
        a, b = (int(v) for v in rng.integers(0, 100, 2))
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    words = [str(w) for w in rng.choice(WORDS, int(rng.integers(2, 9)))]
    if task == 1:
        return "Reverse: " + " ".join(words), " ".join(reversed(words))
    return "Count the words: " + " ".join(words), f"There are {len(words)} words."


def read_jsonl(path: str, prompt_field: str, response_field: str) -> list[tuple[str, str]]:
    """``(prompt, response)`` pairs of a JSONL file; a line without either field is a ``UsageError``."""
    pairs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                pairs.append((str(record[prompt_field]), str(record[response_field])))
            except (ValueError, KeyError, TypeError) as error:
                raise UsageError(f"{path}:{number}: need a JSON object with {prompt_field!r} and "
                                 f"{response_field!r} ({type(error).__name__}: {error})") from None
    if not pairs:
        raise UsageError(f"{path} holds no samples")
    return pairs


class PromptResponses(torch.utils.data.Dataset):
    """``{"prompt_ids", "completion_ids"}`` samples (``SFTCollator``'s input) of ``pairs`` (a list, or a function of
    the index for the built-in set) tokenized on access: the template's prompt, then the response and the end of
    text."""

    def __init__(self, pairs, size: int, tokenizer, offset: int = 0):
        self.pairs, self.size, self.tokenizer, self.offset = pairs, size, tokenizer, offset

    def __len__(self) -> int:
        return self.size

    def text(self, index: int) -> tuple[str, str]:
        pairs = self.pairs
        prompt, response = pairs(self.offset + index) if callable(pairs) else pairs[index % len(pairs)]
        return f"### Question: {prompt}\n### Answer:", f" {response}"

    def __getitem__(self, index: int) -> dict:
        prompt, response = self.text(index)
        encode = self.tokenizer.encode
        return {"prompt_ids": encode(prompt, add_special_tokens=False),
                "completion_ids": encode(response, add_special_tokens=False) + [self.tokenizer.eos_token_id]}


def make_parser():
    """This script's options: the shared ones (``_common.build_parser``), --pack and train_clm.py's long-sequence
    options, and its own."""
    parser = build_parser(__doc__, output="train_sft_out",
                          model_help="Hub id or folder of a causal LM (native family or generic path) with its "
                                     "tokenizer; default: a small Llama from config")
    parser.add_argument("--pack", action="store_true",
                        help="samples packed first-fit into rows of --seq-len tokens (positions restarting per "
                             "sample, attention within each) instead of one padded sample per row; --batch-size "
                             "counts samples")
    add_long_sequence_options(parser)
    parser.add_argument("--prompt-field", default="prompt", help="the prompt's field in a jsonl --data / --eval-data")
    parser.add_argument("--response-field", default="response", help="the response's field in a jsonl file")
    parser.add_argument("--train-samples", type=int, default=0,
                        help="samples in the built-in training set (0: steps x global batch, every sample new)")
    parser.set_defaults(eval_samples=64)
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def prepare_tokenizer(args, context, train_pairs):
    """``--tokenizer`` / ``--model``'s tokenizer, or a BPE trained by rank 0 on the training samples' text into
    OUTPUT/tokenizer while the others wait."""
    source = tokenizer_source(args)
    if source is None:
        source = os.path.join(args.output, "tokenizer")
        if context.is_main_process and not os.path.isfile(os.path.join(source, "tokenizer.json")):
            os.makedirs(args.output, exist_ok=True)
            text_file = os.path.join(args.output, "sft_text.txt")
            samples = train_pairs if isinstance(train_pairs, list) else [train_pairs(i) for i in range(4000)]
            with open(text_file, "w", encoding="utf-8") as handle:
                handle.writelines(f"### Question: {p}\n### Answer: {r}\n" for p, r in samples)
            train_tokenizer(text_file, source, args.vocab_size)
        context.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    check_tokenizer(args, tokenizer)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer from {source} has no end-of-text token to end a response with")
    if tokenizer.pad_token_id is None:  # padding is never attended to nor a target: any id serves
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(args, tokenizer, context):
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    if args.model:
        return om.AutoModelForCausalLM.from_pretrained(args.model, parallel=context, progress=False).train()
    config = small_config(args, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return om.AutoModelForCausalLM.from_config(config, parallel=context).train()


def make_collator(args, cfg: om.ParallelConfig, tokenizer, pack: bool):
    """``SFTCollator`` for this layout: packed (``packing_options``) or padded, to ``--seq-len`` exactly under
    pipeline or context parallelism (the stages' shapes are static; chunks need a divisible length), else to the
    batch's longest sample (a multiple of tp under sequence parallelism)."""
    if pack:
        return om.data.SFTCollator(tokenizer, max_length=args.seq_len, **packing_options(args, cfg))
    fixed = cfg.pipeline_parallel_size > 1 or cfg.context_parallel_size > 1
    multiple = args.seq_len if fixed else (args.tp if args.sequence_parallel else None)
    return om.data.SFTCollator(tokenizer, max_length=args.seq_len, pad_to_multiple_of=multiple)


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.model or args.model_type):
        args.model_type = "llama"  # the default model: a small Llama (no dropout: packed = padded exactly)
    if args.data and not args.data.endswith(".jsonl") or args.eval_data and not args.eval_data.endswith(".jsonl"):
        raise UsageError("--data / --eval-data take a .jsonl file of prompt/response objects")
    # before any process group or model: one clean error per job
    cfg = with_long_sequence_options(args, check_launch(args, om.AutoModelForCausalLM))
    train_pairs = read_jsonl(args.data, args.prompt_field, args.response_field) if args.data else builtin_pair
    eval_pairs = read_jsonl(args.eval_data, args.prompt_field, args.response_field) if args.eval_data else None
    accelerator, context = make_accelerator(args, cfg)
    tokenizer = prepare_tokenizer(args, context, train_pairs)
    model = build_model(args, tokenizer, context)

    global_batch = args.batch_size * args.grad_accum * context.dp_size
    size = args.train_samples or args.steps * global_batch
    dataset = PromptResponses(train_pairs, size, tokenizer)
    held_out = (PromptResponses(eval_pairs, len(eval_pairs), tokenizer) if eval_pairs
                else PromptResponses(builtin_pair, args.eval_samples, tokenizer, offset=HELD_OUT))
    try:
        evaluator = Evaluator(held_out, args.seq_len, lambda: make_collator(args, cfg, tokenizer, pack=False),
                              batch_size=args.batch_size, max_samples=args.eval_samples, context=context)
    except ValueError as error:
        raise UsageError(str(error)) from None
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset,
                                        make_collator(args, cfg, tokenizer, args.pack),
                                        "a prompt + response" + (" (packed)" if args.pack else ""), evaluator)

    model_dir = export(args, accelerator, model, tokenizer, losses, "train_sft.py", reporter)
    if accelerator.is_main_process:
        plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()  # plain transformers
        prompt, truth = held_out.text(0)
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        answer = plain.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        reply = tokenizer.decode(answer[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; Hub folder: {model_dir}")
        print(f"plain transformers answers {prompt!r} with {reply!r} (reference {truth!r})")
    finish(accelerator)


if __name__ == "__main__":
    run(main)
