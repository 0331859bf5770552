"""Random-access samples/s and RSS growth: PackedCausalLMDataset vs a `datasets` Arrow dataset (torch format).

Both hold the same generated tokens (``--gb`` GB of uint16 ids, random documents), cut into samples of
``--seq-len`` tokens. Each reader runs in its own fresh process (so one's pages and allocations do not count
against the other) and reads every sample once in a random order, returning ``torch.int64`` ``input_ids``.

    python benchmarks/data_access.py --gb 1 --json data_access.json

Reports samples/s over the whole pass and RSS growth (peak RSS during the pass minus RSS after opening), plus the
anonymous/file split of RSS at the end (/proc/self/status), so growth from mapped file pages is visible as such.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

VOCAB = 50257  # GPT-2 sized: fits uint16


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_split() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def generate(prefix: Path, gb: float, seed: int) -> int:
    """Write ~``gb`` GB of random uint16 tokens in documents of 50..4000 tokens; return the token count."""
    from oslo_models.data.indexed import write_token_batches

    total = int(gb * 1e9) // 2
    rng = np.random.default_rng(seed)

    def batches():
        left = total
        while left > 0:
            lens = rng.integers(50, 4000, size=4096)
            lens = lens[np.cumsum(lens) <= left] if lens.sum() > left else lens
            if lens.size == 0:
                lens = np.array([left])
            n = int(lens.sum())
            yield rng.integers(0, VOCAB, size=n, dtype=np.uint16), lens
            left -= n

    write_token_batches(prefix, batches(), vocab_size=VOCAB)
    return total


def build_arrow(prefix: Path, seq_len: int, path: Path, layout: str) -> None:
    """Write the samples of an unshuffled PackedCausalLMDataset as an Arrow stream file `datasets` can map.

    ``layout="fixed"``: ``FixedSizeList<uint16>`` rows (the most compact Arrow form); ``"list"``: ``List<int64>``
    rows, what ``Dataset.map`` gives for tokenized-and-grouped text (HF ``run_clm``'s ``group_texts``).
    Written chunk by chunk so the whole corpus is never in memory.
    """
    import pyarrow as pa

    from oslo_models.data import MMapTokenDataset

    data = MMapTokenDataset(prefix)
    num_samples = data.num_tokens // seq_len
    rows = 65536
    with pa.OSFile(str(path), "wb") as sink:
        writer = None
        for lo in range(0, num_samples, rows):
            hi = min(lo + rows, num_samples)
            chunk = np.asarray(data.tokens[lo * seq_len: hi * seq_len])
            if layout == "fixed":
                column = pa.FixedSizeListArray.from_arrays(pa.array(chunk), seq_len)
            else:
                offsets = pa.array(np.arange(hi - lo + 1, dtype=np.int32) * seq_len)
                column = pa.ListArray.from_arrays(offsets, pa.array(chunk.astype(np.int64)))
            batch = pa.record_batch([column], names=["input_ids"])
            if writer is None:
                writer = pa.ipc.new_stream(sink, batch.schema)
            writer.write_batch(batch)
        writer.close()


def _open(kind: str, path: str, seq_len: int):
    if kind == "packed":
        from oslo_models.data import PackedCausalLMDataset

        return PackedCausalLMDataset(path, seq_len=seq_len, seed=0)
    import datasets

    return datasets.Dataset.from_file(path).with_format("torch")  # memory-maps the Arrow file


def _measure(kind: str, path: str, seq_len: int, max_samples: int, seed: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    t_open = time.perf_counter()
    ds = _open(kind, path, seq_len)
    t_open = time.perf_counter() - t_open
    base = rss_bytes()
    order = np.random.default_rng(seed).permutation(len(ds))[:max_samples]
    peak, checksum = base, 0
    start = time.perf_counter()
    for n, i in enumerate(order):
        ids = ds[int(i)]["input_ids"].to(torch.int64)  # what a collator gets
        checksum += int(ids[0])
        if n % 2000 == 0:
            peak = max(peak, rss_bytes())
    elapsed = time.perf_counter() - start
    peak = max(peak, rss_bytes())
    queue.put({"reader": kind, "samples": int(order.size), "of_samples": len(ds), "seconds": elapsed,
               "samples_per_s": order.size / elapsed, "open_s": t_open, "rss_after_open_mb": base / 2**20,
               "rss_growth_mb": (peak - base) / 2**20, "rss_end_split_mb": {k: v / 2**20 for k, v in
                                                                          rss_split().items()},
               "checksum": checksum})


def run_in_child(*args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(*args, queue))
    proc.start()
    while True:  # a crashed child must not leave us waiting forever
        try:
            result = queue.get(timeout=5)
            break
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"benchmark child for {args[0]} died (exit code {proc.exitcode})") from None
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of uint16 tokens to generate (default 1)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--max-samples", type=int, default=0, help="cap samples read per reader (0: all)")
    parser.add_argument("--workdir", default=None, help="where to write the corpora (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--readers", default="packed,arrow_fixed_uint16,arrow_list_int64",
                        help="comma-separated subset of readers to run")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="oslo_data_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t = time.perf_counter()
        num_tokens = generate(work / "corpus", args.gb, args.seed)
        gen_s = time.perf_counter() - t
        readers = args.readers.split(",")
        t = time.perf_counter()
        paths = {"packed": work / "corpus"}
        for name, layout in (("arrow_fixed_uint16", "fixed"), ("arrow_list_int64", "list")):
            if name in readers:
                paths[name] = work / f"{layout}.arrow"
                build_arrow(work / "corpus", args.seq_len, paths[name], layout)
        arrow_s = time.perf_counter() - t
        cap = args.max_samples or (num_tokens // args.seq_len)
        results = [run_in_child(name, str(paths[name]), args.seq_len, cap, args.seed) for name in readers]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    packed = results[0]
    print(f"{num_tokens / 1e6:.0f}M uint16 tokens ({num_tokens * 2 / 1e9:.2f} GB), seq_len {args.seq_len}, "
          f"{packed['of_samples']} samples; generate {gen_s:.1f}s, build arrow files {arrow_s:.1f}s")
    print(f"{'reader':<46}{'samples':>9}{'samples/s':>11}{'speedup':>9}{'RSS growth MB':>15}"
          f"{'RssAnon MB':>12}{'RssFile MB':>12}")
    names = {"packed": "PackedCausalLMDataset (memmap)",
             "arrow_fixed_uint16": "datasets Arrow FixedSizeList<uint16>, torch",
             "arrow_list_int64": "datasets Arrow List<int64>, torch"}
    for r in results:
        split = r["rss_end_split_mb"]
        r["speedup_of_packed"] = packed["samples_per_s"] / r["samples_per_s"]
        print(f"{names[r['reader']]:<46}{r['samples']:>9}{r['samples_per_s']:>11.0f}"
              f"{r['speedup_of_packed']:>8.1f}x{r['rss_growth_mb']:>15.1f}"
              f"{split.get('RssAnon', 0):>12.1f}{split.get('RssFile', 0):>12.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "gb": args.gb, "num_tokens": num_tokens, "seq_len": args.seq_len,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "results": results}, indent=2))


if __name__ == "__main__":
    main()
