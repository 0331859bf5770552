"""`make demo`: train a small GPT-2 from scratch at tp=2 x dp=2 on 4 CPU processes, save a Hub folder, reload
it with plain `transformers` and print a generated sample.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 4 examples/demo_gpt2.py --output demo_out
    torchrun --nproc_per_node 4 examples/demo_gpt2.py --output demo_out        # the same script

The corpus is the built-in public-domain text in examples/data; the tokenizer is a byte-level BPE trained on it
offline with `tokenizers`.
"""
from __future__ import annotations

import argparse
import os

import torch
import transformers
from tqdm.auto import tqdm

import oslo_models as om

HERE = os.path.dirname(os.path.abspath(__file__))


def train_tokenizer(corpus: str, folder: str, vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([corpus], vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                                     bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="demo_out")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)  # every rank alike: same initial full weights, sliced per rank
    context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=args.tp, sequence_parallel=True))
    corpus = open(os.path.join(HERE, "data", "public_domain.txt"), encoding="utf-8").read()
    tokenizer_dir = os.path.join(args.output, "tokenizer")
    if context.rank == 0:
        train_tokenizer(corpus, tokenizer_dir, vocab_size=512)
    context.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = torch.tensor(tokenizer(corpus)["input_ids"])

    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=128, n_layer=2,
                                     n_head=4, bos_token_id=tokenizer.eos_token_id,
                                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    model = om.AutoModelForCausalLM.from_config(config, parallel=context).train()
    ddp = om.data_parallel(model, context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if context.rank == 0:
        print(f"{context}\ncorpus: {len(tokens)} tokens, vocab {len(tokenizer)}; "
              f"{sum(p.numel() for p in model.parameters())} parameters on this rank")

    # Same batch on every rank of a TP group, different batches on different data-parallel ranks.
    generator = torch.Generator().manual_seed(1000 + context.dp_rank)
    progress = tqdm(range(args.steps), desc="training", disable=context.rank != 0, mininterval=1.0)
    first = None
    for step in progress:
        starts = torch.randint(0, len(tokens) - args.seq_len, (args.batch_size,), generator=generator)
        batch = torch.stack([tokens[s:s + args.seq_len] for s in starts])
        loss = ddp(batch, labels=batch, gather_logits=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        first = first if first is not None else loss.item()
        progress.set_postfix(loss=f"{loss.item():.3f}")
        if context.rank == 0 and (step % 100 == 0 or step == args.steps - 1):
            progress.write(f"step {step:4d}  loss {loss.item():.3f}")

    model_dir = os.path.join(args.output, "model")
    model.save_pretrained(model_dir)  # gathered to the plain layout; rank 0 writes
    if context.rank == 0:
        tokenizer.save_pretrained(model_dir)
        plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir)  # plain transformers, no conversion
        prompt = tokenizer("It was the", return_tensors="pt")
        sample = plain.generate(**prompt, max_new_tokens=24, do_sample=False)
        print(f"loss {first:.3f} -> {loss.item():.3f}; saved a Hub folder to {model_dir}")
        print("plain transformers sample:", repr(tokenizer.decode(sample[0])))


if __name__ == "__main__":
    main()
