"""Image-text models: per-rank memory of a LLaVA at tp 1 / 2 / 4, and the packed collator against one sample per row.

    python benchmarks/image_text.py                      # both parts, table + benchmarks/image_text.json
    python benchmarks/image_text.py --part memory --tp 1 2 4
    python benchmarks/image_text.py --part packing --samples 64 --repeats 3

memory: a LLaVA built from config (CLIP tower hidden 256 x 4 layers at 56x56 / patch 14; Llama decoder hidden 512 x 8
layers, vocabulary 16000) loaded through ``om.AutoModelForImageTextToText.from_config`` at tp = 1, 2, 4 (one gloo
process per tp rank, dp 1), one AdamW step on a 4-row image-text batch. Per rank: the bytes of its local parameter
tensors, of its gradients and of its optimizer state (exact, from the tensors), and the process's peak RSS (which
includes torch itself, ~0.4 GiB). The vision tower and projector are replicated on every tp rank (no plan for them in
``transformers``); the decoder and the vocabulary are split.

packing: the built-in shapes-caption set through ``om.data.ImageTextCollator`` with a word-level tokenizer and a
LLaVA processor (16 image tokens per 28x28 image), one sample per row (right padding) against ``pack_to`` tokens per
row, and a tiny LLaVA (hidden 64) training on it in one process: collated samples per second (the processor's work),
and real tokens per second of forward + backward (median of ``--repeats`` after one warm-up), with the two layouts'
losses checked equal.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _llava_config(vocab=16000, hidden=512, layers=8):
    import transformers

    text = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=512, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, image_size=56, patch_size=14, projection_dim=256)
    return transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision, image_token_id=vocab - 1,
                                    vision_feature_layer=-1)


def _local_bytes(tensors) -> int:
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _memory_rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import oslo_models as om

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = _llava_config()
    parallel = om.ParallelConfig(tensor_parallel_size=world) if world > 1 else None
    model = om.AutoModelForImageTextToText.from_config(config, parallel=parallel).train()
    gen = torch.Generator().manual_seed(1)
    rows, image_tokens = 4, 16
    ids = torch.randint(3, 15000, (rows, 48), generator=gen)
    ids[:, 2:2 + image_tokens] = config.image_token_id
    labels = ids.clone()
    labels[:, :2 + image_tokens] = -100
    batch = {"input_ids": ids, "labels": labels, "pixel_values": torch.randn(rows, 3, 56, 56, generator=gen)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - start
    vision = set(om.image_text.vision_parameter_names(model))
    params = dict(model.named_parameters())
    result = {
        "tp": world, "rank": rank,
        "params_MiB": _local_bytes(params.values()) / 2 ** 20,
        "vision_params_MiB": _local_bytes(params[n] for n in vision) / 2 ** 20,
        "grads_MiB": _local_bytes(p.grad for p in params.values()) / 2 ** 20,
        "adam_state_MiB": _local_bytes(t for s in opt.state.values() for t in s.values() if t.dim() > 0) / 2 ** 20,
        "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": seconds, "loss": float(loss.detach()),
    }
    with open(os.path.join(out, f"mem_tp{world}_rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def memory(tps, folder) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    results = []
    for tp in tps:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_memory_rank, args=(tp, port, folder), nprocs=tp, join=True)
        for rank in range(tp):
            with open(os.path.join(folder, f"mem_tp{tp}_rank{rank}.json")) as handle:
                results.append(json.load(handle))
    return results


def packing(samples: int, pack_to: int, repeats: int, batch_size: int) -> dict:
    import oslo_models as om
    from oslo_models.image_text.demo import ShapesCaptions, llava_processor, tiny_llava_config

    torch.set_num_threads(1)
    processor = llava_processor()
    data = [ShapesCaptions(samples)[i] for i in range(samples)]
    torch.manual_seed(0)
    model = om.AutoModelForImageTextToText.from_config(tiny_llava_config(processor.tokenizer)).train()
    out = {"samples": samples, "pack_to": pack_to, "batch_size": batch_size}
    losses = {}
    for name, collator in (("one_per_row", om.data.ImageTextCollator(processor)),
                           ("packed", om.data.ImageTextCollator(processor, pack_to=pack_to))):
        start = time.perf_counter()
        batches = [collator(data[i:i + batch_size]) for i in range(0, samples, batch_size)]
        collate_s = time.perf_counter() - start
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        slots = sum(b["input_ids"].numel() for b in batches)
        times, total = [], None
        for _ in range(repeats + 1):
            start = time.perf_counter()
            total = 0.0
            for batch in batches:
                loss = model(**batch).loss
                loss.backward()
                total += float(loss.detach())
            model.zero_grad()
            times.append(time.perf_counter() - start)
        median = statistics.median(times[1:])
        losses[name] = total
        out[name] = {"rows": sum(b["input_ids"].shape[0] for b in batches), "real_tokens": real, "token_slots": slots,
                     "collate_samples_per_s": samples / collate_s, "train_s": median,
                     "real_tokens_per_s": real / median}
    out["speedup"] = out["packed"]["real_tokens_per_s"] / out["one_per_row"]["real_tokens_per_s"]
    out["loss_sum"] = losses
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["memory", "packing", "both"], default="both")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per collated batch")
    parser.add_argument("--pack-to", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "image_text.json"))
    args = parser.parse_args(argv)
    report = {}
    if args.part in ("memory", "both"):
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            report["memory"] = memory(args.tp, folder)
        print("| tp | rank | params MiB (vision) | grads MiB | Adam state MiB | peak RSS MiB | step s |")
        print("|---|---|---|---|---|---|---|")
        for row in report["memory"]:
            print(f"| {row['tp']} | {row['rank']} | {row['params_MiB']:.1f} ({row['vision_params_MiB']:.1f}) | "
                  f"{row['grads_MiB']:.1f} | {row['adam_state_MiB']:.1f} | {row['peak_rss_MiB']:.0f} | "
                  f"{row['step_s']:.2f} |")
    if args.part in ("packing", "both"):
        result = report["packing"] = packing(args.samples, args.pack_to, args.repeats, args.batch_size)
        print("| layout | rows | real / slots | collate samples/s | train s | real tokens/s |")
        print("|---|---|---|---|---|---|")
        for name in ("one_per_row", "packed"):
            row = result[name]
            print(f"| {name} | {row['rows']} | {row['real_tokens']} / {row['token_slots']} | "
                  f"{row['collate_samples_per_s']:.0f} | {row['train_s']:.2f} | {row['real_tokens_per_s']:.0f} |")
        print(f"packed / one per row: {result['speedup']:.2f}x; loss sums {result['loss_sum']}")
    with open(args.output, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
