"""Pretrain or fine-tune T5 on span corruption with tensor parallelism, ZeRO over the data-parallel group and
Accelerate.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/train_seq2seq.py --tp 2   # CPU
    accelerate launch --num_processes 4 examples/train_seq2seq.py --model t5-small --tp 2 --zero 2 --bf16
    torchrun --nproc_per_node 2 examples/train_seq2seq.py --tp 2 --steps 50
    torchrun --nproc_per_node 4 examples/train_seq2seq.py --cp 2 --zero 1   # source and target split over 2 ranks

Without ``--model`` a tiny T5 is built from config; without ``--data`` the built-in public-domain corpus
(examples/data) is tokenized with a BPE (``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2 and ``--sentinels``
``<extra_id_N>`` tokens at the end of the vocabulary, as T5's) trained on it offline. Packed windows of
``om.data.t5_lengths(--seq-len)`` raw tokens become ``--seq-len``-token encoder inputs through
``om.data.T5SpanCorruptionCollator`` (15% noise, mean span 3).

Writes to ``--output``: ``checkpoint/`` (``--resume``), ``loss.json``, ``loss.png`` and ``model/``, a Hub folder that
plain ``transformers.T5ForConditionalGeneration`` loads. Options and ``--config run.yaml`` as in train_clm.py.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import transformers

import oslo_models as om
from _common import build_parser, check_launch, export, finish, fit, make_accelerator, run, small_config
from _common import parse_args as _parse_args
from _data import prepare_data
from _evaluate import evaluator_for


def make_parser():
    """This script's options: the shared ones (``_common.build_parser``) and its own."""
    parser = build_parser(__doc__, output="train_seq2seq_out", lr=3e-3,
                          model_help="Hub id or folder to fine-tune, of any seq2seq type; default: a tiny T5 from "
                                     "config",
                          vocab_help="BPE size (sentinels included) when training a tokenizer")
    parser.add_argument("--d-kv", type=int, default=32, help="per-head size of the tiny T5")
    parser.add_argument("--sentinels", type=int, default=100, help="<extra_id_N> tokens of a trained tokenizer")
    parser.add_argument("--noise-density", type=float, default=0.15, help="fraction of tokens corrupted")
    parser.add_argument("--mean-noise-span-length", type=float, default=3.0, help="mean corrupted span length")
    parser.add_argument("--prompt", default="Shall I <extra_id_0> thee to a summer's <extra_id_1>?",
                        help="spans filled in by the saved model at the end")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def tokenizer_trainer(sentinels: int):
    def train_tokenizer(text_file: str, folder: str, vocab_size: int):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE(unk_token="<unk>"))
        bpe.pre_tokenizer = pre_tokenizers.Metaspace()
        bpe.decoder = decoders.Metaspace()
        bpe.train([text_file], trainers.BpeTrainer(vocab_size=max(vocab_size - sentinels, 64), min_frequency=2,
                                                   special_tokens=["<pad>", "</s>", "<unk>"], show_progress=False))
        extra = [f"<extra_id_{i}>" for i in range(sentinels)]
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>",
                                                         unk_token="<unk>", additional_special_tokens=extra)
        tokenizer.save_pretrained(folder)
    return train_tokenizer


def pad_multiple(args) -> int | None:
    """Source and target lengths padded to a multiple of tp under sequence parallelism and of the context-parallel
    chunks (``2 cp`` for the ring, ``cp`` for all-to-all: each side is split into them)."""
    multiple = args.tp if args.sequence_parallel else 1
    if args.cp > 1:
        chunks = 2 * args.cp if args.cp_mode == "ring" else args.cp
        multiple = multiple * chunks // math.gcd(multiple, chunks)
    return multiple if multiple > 1 else None


def build_model(args, tokenizer, context):
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    if args.model:
        return om.AutoModelForSeq2SeqLM.from_pretrained(args.model, parallel=context, progress=False).train()
    if args.model_type:  # any transformers type, native or generic
        config = small_config(args, len(tokenizer), decoder_start_token_id=tokenizer.pad_token_id,
                              pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id)
        return om.AutoModelForSeq2SeqLM.from_config(config, parallel=context).train()
    config = transformers.T5Config(vocab_size=len(tokenizer), d_model=args.n_embd, d_kv=args.d_kv,
                                   d_ff=4 * args.n_embd, num_layers=args.n_layer, num_decoder_layers=args.n_layer,
                                   num_heads=args.n_head, dropout_rate=0.0, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=tokenizer.eos_token_id,
                                   decoder_start_token_id=tokenizer.pad_token_id)
    return om.AutoModelForSeq2SeqLM.from_config(config, parallel=context).train()


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = check_launch(args, om.AutoModelForSeq2SeqLM)  # before any process group or model: one clean error per job
    accelerator, context = make_accelerator(args, cfg)
    prefix, eval_prefix, tokenizer = prepare_data(args, context, tokenizer_trainer(args.sentinels))
    model = build_model(args, tokenizer, context)

    raw_len, target_len = om.data.t5_lengths(args.seq_len, args.noise_density, args.mean_noise_span_length)
    global_batch = args.batch_size * args.grad_accum * context.dp_size
    dataset = om.data.PackedCausalLMDataset(prefix, raw_len, seed=args.seed, num_samples=args.steps * global_batch)
    make_collator = functools.partial(om.data.T5SpanCorruptionCollator, tokenizer, noise_density=args.noise_density,
                                      mean_noise_span_length=args.mean_noise_span_length, seed=args.seed,
                                      pad_to_multiple_of=pad_multiple(args))
    evaluator = evaluator_for(args, context, eval_prefix, raw_len, make_collator)
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset, make_collator(),
                                        f"{raw_len} raw -> {args.seq_len} input / {target_len} target tokens",
                                        evaluator)

    model_dir = export(args, accelerator, model, tokenizer, losses, "train_seq2seq.py", reporter)
    if accelerator.is_main_process:
        plain = transformers.T5ForConditionalGeneration.from_pretrained(model_dir).eval()  # plain transformers
        enc = tokenizer(args.prompt, return_tensors="pt")
        sample = plain.generate(**enc, max_new_tokens=16, do_sample=False)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; Hub folder: {model_dir}; "
              f"curve: {os.path.join(args.output, 'loss.png')}")
        print("plain transformers spans:", repr(tokenizer.decode(sample[0])))
    finish(accelerator)


if __name__ == "__main__":
    run(main)
