"""Context-parallel ring at cp 2: forward + backward time of the attention core, FlexAttention blocks against the
fp32 masked tiles (issue 52).

    python benchmarks/context_parallel_flex.py [--seq 2048 4096 8192] [--repeats 2] \
        [--json benchmarks/context_parallel_flex.json]

Two gloo ranks on CPU (one thread each) run ``ring_attention`` on one row of ``S`` tokens (the ring's mirrored
chunks, ``S/2`` per rank), ``b=1``, 4 heads of 64, fp32, on two masks:

- ``causal``: one document, causal only: the tile path runs torch's CPU flash kernel per chunk pair there;
- ``packed+window``: 4 documents of unequal lengths (position ids restarting) and a sliding window of 512: the tile
  path computes masked fp32 tiles, the Flex path one ``flex_attention`` call per query tile and ring step with the
  pair's block mask.

Each case: one warm-up, then the median of ``--repeats`` timed forward + backward calls (rank 0's wall clock; both
ranks wait for each other at every ring step). The outputs of the two paths are compared (max abs difference).
On CPU the Flex kernel runs uncompiled (torch's compiled CPU Flex returns no log-sum-exp; Flex has no CPU
backward, so the Flex path's backward is the tile recompute): expect it to be no faster there.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, HEAD_DIM, WINDOW = 4, 64, 512


def _documents(seq: int) -> torch.Tensor:
    """Position ids of 4 documents of unequal lengths (fractions 0.1, 0.4, 0.2, 0.3 of the row)."""
    cuts = [int(seq * f) for f in (0.1, 0.4, 0.2)]
    lengths = cuts + [seq - sum(cuts)]
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _case(context, seq: int, case: str, impl: str, repeats: int):
    from oslo_models.parallel_layers.context_parallel import build_context_parallel_mask, split_sequence
    from oslo_models.parallel_layers.context_parallel.ring import ring_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(4))
    local = (lambda t: split_sequence(t, context.cp_rank, 2, "ring", dim=2))
    positions = split_sequence(_documents(seq), context.cp_rank, 2, "ring") if case != "causal" else None
    mask = build_context_parallel_mask(context, None, torch.empty(1, seq // 2, 1), causal=True,
                                       position_ids=positions)
    window = WINDOW if case != "causal" else None
    times, out = [], None
    for run in range(repeats + 1):
        leaves = [local(t).requires_grad_() for t in (q, k, v)]
        dist.barrier()
        start = time.perf_counter()
        out = ring_attention(*leaves, mask, scaling=HEAD_DIM ** -0.5, window=window, impl=impl)
        out.backward(local(grad))
        dist.barrier()
        if run:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2], out.detach()


def _worker(rank: int, port: int, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import oslo_models as om

    context = om.ParallelContext.from_config(om.ParallelConfig(context_parallel_size=2, context_parallel_mode="ring"))
    rows = []
    for seq in args.seq:
        for case in ("causal", "packed+window"):
            tiles, out_tiles = _case(context, seq, case, "tiles", args.repeats)
            flex, out_flex = _case(context, seq, case, "flex", args.repeats)
            gap = (out_tiles - out_flex).abs().max().reshape(1)
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
            rows.append(dict(seq=seq, case=case, tiles_s=round(tiles, 3), flex_s=round(flex, 3),
                             flex_over_tiles=round(flex / tiles, 2), max_abs_diff=float(gap)))
            if rank == 0:
                print(f"seq {seq} {case}: tiles {tiles:.3f} s, flex {flex:.3f} s", flush=True)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "context_parallel_flex.json"))
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(rank, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    rows = queue.get()
    for proc in procs:
        proc.join()
    header = f"{'seq':>6} {'case':>14} {'tiles s':>9} {'flex s':>9} {'flex/tiles':>11} {'max |diff|':>11}"
    print(header)
    for row in rows:
        print(f"{row['seq']:>6} {row['case']:>14} {row['tiles_s']:>9.3f} {row['flex_s']:>9.3f} "
              f"{row['flex_over_tiles']:>11.2f} {row['max_abs_diff']:>11.2e}")
    result = dict(machine="2-core shared CPU box, gloo, 1 thread per rank", torch=torch.__version__,
                  heads=HEADS, head_dim=HEAD_DIM, window=WINDOW, cp=2, mode="ring", rows=rows,
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
