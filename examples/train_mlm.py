"""Pretrain or fine-tune a masked LM (BERT) with tensor parallelism, ZeRO over the data-parallel group and Accelerate.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/train_mlm.py --tp 2   # CPU
    accelerate launch --num_processes 4 examples/train_mlm.py --model bert-base-uncased --tp 2 --zero 2 --bf16
    torchrun --nproc_per_node 2 examples/train_mlm.py --tp 2 --sequence-parallel --steps 50

``--model`` takes a masked LM of any type (native family or, e.g. ``megatron-bert``, the generic path); ``--model-type
TYPE`` builds a small new one of any type. Without either a tiny BERT is built from config; without ``--data`` the
built-in public-domain corpus (examples/data) is tokenized with a WordPiece vocabulary ([PAD] [UNK] [CLS] [SEP] [MASK])
trained on it offline. Samples are packed ``--seq-len`` windows of the corpus, masked 80/10/10 by
``om.data.MLMCollator``.

Writes to ``--output``: ``checkpoint/`` (``--resume``), ``loss.json``, ``loss.png`` and ``model/``, a Hub folder that
plain ``transformers.BertForMaskedLM`` loads. Options and ``--config run.yaml`` as in train_clm.py.
"""
from __future__ import annotations

import functools
import os

import torch
import transformers

import oslo_models as om
from _common import build_parser, check_launch, export, finish, fit, make_accelerator, run, small_config
from _common import parse_args as _parse_args
from _data import prepare_data
from _evaluate import evaluator_for

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_parser():
    """This script's options: the shared ones (``_common.build_parser``) and its own."""
    parser = build_parser(__doc__, output="train_mlm_out", lr=1e-3,
                          model_help="Hub id or folder to fine-tune, of any masked-LM type; default: a tiny BERT "
                                     "from config",
                          vocab_help="WordPiece size when training a tokenizer")
    parser.add_argument("--mlm-probability", type=float, default=0.15, help="fraction of tokens masked (80/10/10)")
    parser.add_argument("--whole-word-mask", action="store_true", help="mask all pieces of a chosen word")
    parser.add_argument("--prompt", default="Shall I [MASK] thee to a summer's day?",
                        help="filled in by the saved model at the end")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def train_tokenizer(text_file: str, folder: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    wp = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wp.normalizer = normalizers.BertNormalizer(lowercase=True)
    wp.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wp.decoder = decoders.WordPiece()
    wp.train([text_file], trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL,
                                                    show_progress=False))
    cls, sep = wp.token_to_id("[CLS]"), wp.token_to_id("[SEP]")
    wp.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                      special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=wp, pad_token="[PAD]", unk_token="[UNK]",
                                                     cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    tokenizer.save_pretrained(folder)


def build_model(args, tokenizer, context):
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    if args.model:
        return om.AutoModelForMaskedLM.from_pretrained(args.model, parallel=context, progress=False).train()
    if args.model_type:  # any transformers type, native or generic
        config = small_config(args, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        return om.AutoModelForMaskedLM.from_config(config, parallel=context).train()
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=args.n_embd,
                                     num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                                     intermediate_size=4 * args.n_embd, max_position_embeddings=max(64, args.seq_len),
                                     pad_token_id=tokenizer.pad_token_id)
    return om.AutoModelForMaskedLM.from_config(config, parallel=context).train()


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = check_launch(args, om.AutoModelForMaskedLM)  # before any process group or model: one clean error per job
    accelerator, context = make_accelerator(args, cfg)
    prefix, eval_prefix, tokenizer = prepare_data(args, context, train_tokenizer)
    model = build_model(args, tokenizer, context)

    global_batch = args.batch_size * args.grad_accum * context.dp_size
    dataset = om.data.PackedCausalLMDataset(prefix, args.seq_len, seed=args.seed,
                                            num_samples=args.steps * global_batch)
    make_collator = functools.partial(om.data.MLMCollator, tokenizer, mlm_probability=args.mlm_probability,
                                      whole_word_mask=args.whole_word_mask, seed=args.seed)
    evaluator = evaluator_for(args, context, eval_prefix, args.seq_len, make_collator)
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset, make_collator(),
                                        f"{args.seq_len} tokens", evaluator)

    model_dir = export(args, accelerator, model, tokenizer, losses, "train_mlm.py", reporter)
    if accelerator.is_main_process:
        plain = transformers.BertForMaskedLM.from_pretrained(model_dir).eval()  # plain transformers
        enc = tokenizer(args.prompt, return_tensors="pt")
        with torch.no_grad():
            logits = plain(**enc).logits[0]
        where = (enc["input_ids"][0] == tokenizer.mask_token_id).nonzero().flatten()
        guesses = [tokenizer.convert_ids_to_tokens(logits[i].topk(5).indices.tolist()) for i in where.tolist()]
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; Hub folder: {model_dir}; "
              f"curve: {os.path.join(args.output, 'loss.png')}")
        print("plain transformers fill-mask:", repr(args.prompt), "->", guesses)
    finish(accelerator)


if __name__ == "__main__":
    run(main)
