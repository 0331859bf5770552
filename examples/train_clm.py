"""Train a causal LM (any transformers type: the native families, and every other type on the generic path) with
tensor parallelism, ZeRO over data parallelism and Accelerate.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 examples/train_clm.py --tp 2   # CPU
    accelerate launch --num_processes 4 examples/train_clm.py --model gpt2 --tp 2 --zero 2 --bf16 --data corpus
    torchrun --nproc_per_node 4 examples/train_clm.py --tp 2 ...                                       # same script
    ... examples/train_clm.py --pp 2 --tp 2 --microbatches 4 --schedule 1f1b --n-layer 4   # pipeline x tensor
    ... examples/train_clm.py --model path/to/llama-or-qwen --tp 2 --sequence-parallel   # fine-tune a checkpoint
    ... examples/train_clm.py --model path/to/llama --tp 2 --cp 2 --cp-mode all_to_all   # long sequences
    ... examples/train_clm.py --model path/to/mixtral --ep 2 --tp 2                   # experts over ranks
    ... examples/train_clm.py --model path/to/granite --tp 2 --zero 3   # no native family: transformers' own class
    ... examples/train_clm.py --model-type mamba --zero 2   # a small new model of any type (here a state space model)
    ... examples/train_clm.py --plan auto --global-batch-size 64   # the planner picks the layout for this world
    ... examples/train_clm.py --pack --seq-len 256 --batch-size 16   # whole documents packed first-fit per row
    ... examples/train_clm.py --pack --pp 2 --microbatches 4 --batch-size 16   # packed rows through a pipeline
    ... examples/train_clm.py --seq-len 4096 --tiled-mlp auto --tiled-loss --activation-offload   # long sequences
    python examples/train_clm.py --config run.yaml          # any option below as a YAML key (dashes or underscores)

``--model`` takes any causal LM (a Hub id or a local folder with its tokenizer): the native class when the type has a
family (the README's support matrix), otherwise ``transformers``' own class on the generic path
(``om.capabilities(type)`` says which axes apply; a refused layout is one clean error before anything starts).
``--model-type TYPE`` builds a small random model of any type; without either a small GPT-2 is built from config;
without ``--data`` the
built-in public-domain corpus (examples/data) is tokenized with a byte-level BPE trained on it offline
(``tokenizers``). ``--data`` takes a ``.bin/.idx`` prefix written by ``python -m oslo_models.data preprocess`` or a
text/jsonl file (tokenized here).

Writes to ``--output``: ``checkpoint/`` (resumable: ``--resume``), ``loss.json``, ``loss.png`` (with matplotlib) and
``model/``, a Hub folder that plain ``transformers`` loads (``--push-to-hub ID`` uploads it). ``--eval-data FILE``
reports held-out loss and perplexity (``--eval-every N``); ``--report-to jsonl,tensorboard,...`` logs through
Accelerate's trackers. Mixed precision follows ``accelerate launch --mixed_precision`` and the accelerate config
file unless ``--mixed-precision`` (``--bf16``) overrides it.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import transformers

import oslo_models as om
from _common import UsageError, build_parser, check_launch, export, finish, fit, make_accelerator, run, small_config
from _common import parse_args as _parse_args
from _data import prepare_data as _prepare_data
from _evaluate import evaluator_for


def make_parser():
    """This script's options: the shared ones (``_common.build_parser``) and its own."""
    parser = build_parser(__doc__, output="train_clm_out",
                          model_help="Hub id or folder to fine-tune, of any causal-LM type (native family or "
                                     "generic path); default: a small GPT-2 from config")
    parser.add_argument("--prompt", default="Shall I compare thee", help="sampled from the saved model at the end")
    parser.add_argument("--pack", action="store_true",
                        help="whole documents packed first-fit into rows of --seq-len tokens (positions restarting "
                             "per document; attention within each document) instead of fixed windows across "
                             "documents; --batch-size counts documents")
    add_long_sequence_options(parser)
    return parser


def add_long_sequence_options(parser) -> None:
    """``--tiled-mlp``, ``--tiled-loss``, ``--activation-offload`` (read by :func:`with_long_sequence_options`);
    train_sft.py takes them too."""
    parser.add_argument("--tiled-mlp", metavar="N", default=None,
                        help="long sequences: every decoder block's feed-forward in N sequence slices recomputed in "
                             "the backward, or 'auto' (ceil(seq / hidden)); ParallelConfig.tiled_mlp (needs no "
                             "dropout in the MLP: the default GPT-2 is then built with resid_pdrop=0)")
    parser.add_argument("--tiled-loss", action="store_true",
                        help="long sequences: the training loss fused with the LM head in row chunks, no [seq, "
                             "vocab] logits; ParallelConfig.tiled_loss")
    parser.add_argument("--activation-offload", metavar="BYTES", nargs="?", const=True, default=False,
                        help="long sequences: what each block saves for its backward lives in host memory (a "
                             "tensor of at least BYTES moves; without a value the default threshold); "
                             "ParallelConfig.activation_offload")


def with_long_sequence_options(args, cfg: om.ParallelConfig) -> om.ParallelConfig:
    """``cfg`` with ``--tiled-mlp``, ``--tiled-loss`` and ``--activation-offload``; a value ``ParallelConfig``
    refuses is a ``UsageError``."""
    tiles = args.tiled_mlp
    if tiles is not None and tiles != "auto":
        try:
            tiles = int(tiles)
        except ValueError:
            raise UsageError(f"--tiled-mlp takes a number of slices or 'auto', got {tiles!r}") from None
    offload = args.activation_offload
    if isinstance(offload, str):
        try:
            offload = int(offload)
        except ValueError:
            raise UsageError(f"--activation-offload takes a byte threshold (an int), got {offload!r}") from None
    if (tiles is not None or args.tiled_loss or offload is not False) and (args.model or args.model_type):
        config = (transformers.AutoConfig.from_pretrained(args.model) if args.model
                  else small_config(args, args.vocab_size))
        if not hasattr(om.AutoModelForCausalLM.model_class_for(config), "parallel_plan"):
            raise UsageError(f"--tiled-mlp / --tiled-loss / --activation-offload apply to the native families; "
                             f"{config.model_type!r} runs on the generic path, which does not take them")
    try:
        return dataclasses.replace(cfg, tiled_mlp=tiles, tiled_loss=args.tiled_loss, activation_offload=offload)
    except (ValueError, NotImplementedError) as error:
        raise UsageError(str(error)) from None


def packing_options(args, cfg: om.ParallelConfig) -> dict:
    """``--pack``'s collator keywords (``CausalLMCollator`` / ``SFTCollator``): rows of ``--seq-len`` tokens; under
    pipeline parallelism the row count padded with empty rows to a multiple of the microbatches (the number of
    packed rows depends on the documents' lengths) and no ``cu_seqlens`` (a flat ``[n + 1]`` tensor that does not
    split by rows: the restarting ``position_ids`` carry the documents)."""
    if cfg.pipeline_parallel_size == 1:
        return {"pack_to": args.seq_len}
    return {"pack_to": args.seq_len, "rows_multiple_of": cfg.num_microbatches or cfg.pipeline_parallel_size,
            "return_cu_seqlens": False}


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def train_tokenizer(text_file: str, folder: str, vocab_size: int):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([text_file], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
              show_progress=False)
    eos = "<|endoftext|>"
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos, bos_token=eos,
                                                     pad_token=eos)
    tokenizer.save_pretrained(folder)


def prepare_data(args, context):
    """Tokenizer and corpus prefix; rank 0 builds what is missing while the others wait."""
    return _prepare_data(args, context, train_tokenizer)


def build_model(args, tokenizer, context):
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    if args.model:
        return om.AutoModelForCausalLM.from_pretrained(args.model, parallel=context, progress=False).train()
    if args.model_type:  # any transformers type, native or generic
        config = small_config(args, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        return om.AutoModelForCausalLM.from_config(config, parallel=context).train()
    config = gpt2_config(args, len(tokenizer), tokenizer.eos_token_id)
    return om.AutoModelForCausalLM.from_config(config, parallel=context).train()


def gpt2_config(args, vocab_size: int, eos: int | None = None):
    """The small GPT-2 built when neither --model nor --model-type is given (also what --plan auto plans)."""
    # --tiled-mlp: the tiles' recompute would draw other dropout masks, so this GPT-2's MLP has none
    extra = {"resid_pdrop": 0.0} if getattr(args, "tiled_mlp", None) is not None else {}
    return transformers.GPT2Config(vocab_size=vocab_size, n_positions=args.seq_len, n_embd=args.n_embd,
                                   n_layer=args.n_layer, n_head=args.n_head, bos_token_id=eos, eos_token_id=eos,
                                   pad_token_id=eos, **extra)


class Documents:
    """``--pack``: the corpus's documents as samples, ``num_samples`` of them (cycling over the corpus)."""

    def __init__(self, prefix, num_samples: int):
        self.corpus, self.num_samples = om.data.MMapTokenDataset(prefix), num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        return self.corpus[index % len(self.corpus)]


def main(argv=None) -> None:
    args = parse_args(argv)
    # before any process group or model: one clean error per job (and --plan auto's layout)
    cfg = with_long_sequence_options(args, check_launch(args, om.AutoModelForCausalLM, gpt2_config))
    accelerator, context = make_accelerator(args, cfg)
    prefix, eval_prefix, tokenizer = prepare_data(args, context)
    model = build_model(args, tokenizer, context)

    global_batch = args.batch_size * args.grad_accum * context.dp_size
    if args.pack:  # one sample per document, cycled; the collator packs a batch's documents into rows
        dataset = Documents(prefix, args.steps * global_batch)
        collator = om.data.CausalLMCollator(**packing_options(args, cfg))
    else:
        dataset = om.data.PackedCausalLMDataset(prefix, args.seq_len, seed=args.seed,
                                                num_samples=args.steps * global_batch)
        collator = om.data.CausalLMCollator()
    evaluator = evaluator_for(args, context, eval_prefix, args.seq_len, om.data.CausalLMCollator)
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset, collator,
                                        "a packed document" if args.pack else f"{args.seq_len} tokens", evaluator)

    model_dir = export(args, accelerator, model, tokenizer, losses, "train_clm.py", reporter)
    if accelerator.is_main_process:
        plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir)  # plain transformers, no conversion
        prompt = tokenizer(args.prompt, return_tensors="pt")
        sample = plain.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; Hub folder: {model_dir}; "
              f"curve: {os.path.join(args.output, 'loss.png')}")
        print("plain transformers sample:", repr(tokenizer.decode(sample[0])))
    finish(accelerator)


if __name__ == "__main__":
    run(main)
