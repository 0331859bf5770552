"""Context parallelism: per-rank activation memory of one training step at cp 1/2/4, and bytes moved per layer.

    python benchmarks/context_parallel.py [--seq 2048 4096 8192 16384 32768] [--cp 1 2 4] \
        [--json benchmarks/context_parallel.json]

A GPT-2 (n_embd 64, 2 layers, 4 heads, vocab 256, fp32) runs one forward + backward on one sequence of ``S``
tokens split over ``cp`` gloo ranks on CPU (ring and all-to-all), batches cut by ``ContextParallelSplitter``.

Per rank it records:

- ``saved``: bytes of the distinct tensors autograd keeps for the backward (``torch.autograd.graph.
  saved_tensors_hooks`` during the forward): the activation memory that context parallelism is meant to divide.
  Target: ``saved(cp) / saved(1)`` within 15% of ``1/cp``.
- ``peak_rss``: the process' resident-set high-water mark during forward + backward minus the RSS before it
  (``oslo_models.utils.memory.PeakRSS``): what the step really touched, transients (attention tiles, the
  ring's receive buffers, gradients) included; the allocator and the gloo buffers make it noisier.
- bytes sent per layer (forward + backward), counted by a shim around ``torch.distributed.batch_isend_irecv`` and
  ``all_to_all_single`` in this benchmark process only, next to the formula (``b`` batch, ``n`` heads, ``s = S/cp``,
  ``d`` head dim, ``e = 4`` bytes): ring ``(cp-1)*2bnsde`` forward + ``(cp-1)*2bnsde + cp*2bnsd*4`` backward
  (key/value blocks, then their fp32 gradients, which make one extra hop home); all-to-all ``8*(cp-1)/cp*bnsde``
  (q, k, v and the output, forward and backward; the ``1/cp`` a rank keeps is not sent).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, LAYERS, HEADS, VOCAB = 64, 2, 4, 256


class _SendCounter:
    """Bytes this rank sends through the two collectives context parallelism uses (measurement shim)."""

    def __init__(self):
        import torch.distributed as dist

        self.bytes, self._dist = 0, dist
        self._p2p, self._a2a = dist.batch_isend_irecv, dist.all_to_all_single

        def batch_isend_irecv(ops):
            self.bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return self._p2p(ops)

        def all_to_all_single(output, input, *args, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.bytes += input.numel() * input.element_size() * (size - 1) // size
            return self._a2a(output, input, *args, group=group, **kwargs)

        dist.batch_isend_irecv, dist.all_to_all_single = batch_isend_irecv, all_to_all_single

    def close(self):
        self._dist.batch_isend_irecv, self._dist.all_to_all_single = self._p2p, self._a2a


def _step(seq: int, mode: str) -> dict:
    import transformers

    import oslo_models as om
    from oslo_models.data import ContextParallelSplitter
    from oslo_models.utils.memory import PeakRSS

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = om.ParallelConfig(context_parallel_size=world, context_parallel_mode=mode)
    config = transformers.GPT2Config(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=seq,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = om.GPT2LMHeadModel.from_config(config, parallel=cfg).train()
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    batch = ContextParallelSplitter(model.parallel_context)(dict(input_ids=ids, labels=ids))
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    counter = _SendCounter() if world > 1 else None
    start = time.perf_counter()
    with PeakRSS() as peak:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch).loss
        loss.backward()
    seconds = time.perf_counter() - start
    sent = counter.bytes if counter else 0
    if counter:
        counter.close()
    return {"saved": sum(saved.values()), "peak_rss": peak.growth_bytes, "sent_per_layer": sent / LAYERS,
            "seconds": seconds, "loss": loss.item()}


def formula_per_layer(seq: int, cp: int, mode: str) -> float:
    s, d, e = seq // cp, HIDDEN // HEADS, 4
    block = HEADS * s * d * e  # one of q, k, v, out on one rank (batch 1)
    if cp == 1:
        return 0.0
    if mode == "ring":
        return (cp - 1) * 2 * block + (cp - 1) * 2 * block + cp * 2 * HEADS * s * d * 4
    return 8 * (cp - 1) / cp * block


def _worker(seqs: list[int], mode: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    rows = [_step(seq, mode) for seq in seqs]
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [rows]
    if dist.is_initialized():
        dist.all_gather_object(gathered, rows)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as handle:
            json.dump(gathered, handle)


def main() -> None:
    from tests.helpers.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["ring", "all_to_all"])
    parser.add_argument("--json", default="context_parallel.json")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for cp in args.cp:
            for mode in (["ring"] if cp == 1 else args.modes):
                out = os.path.join(tmp, f"{cp}-{mode}.json")
                run_distributed(_worker, cp, args.seq, mode, out, timeout=3000)
                with open(out) as handle:
                    per_rank = json.load(handle)
                for i, seq in enumerate(args.seq):
                    ranks = [rank_rows[i] for rank_rows in per_rank]
                    results.append({"cp": cp, "mode": "-" if cp == 1 else mode, "seq": seq,
                                    "saved_max": max(r["saved"] for r in ranks),
                                    "peak_rss_max": max(r["peak_rss"] for r in ranks),
                                    "sent_per_layer": max(r["sent_per_layer"] for r in ranks),
                                    "formula_per_layer": formula_per_layer(seq, cp, mode),
                                    "seconds": max(r["seconds"] for r in ranks), "loss": ranks[0]["loss"]})
    base = {r["seq"]: r for r in results if r["cp"] == 1}
    print(f"{'cp':>3} {'mode':>10} {'seq':>6} {'saved MiB':>10} {'x of cp1':>8} {'1/cp':>5} {'peak RSS MiB':>12} "
          f"{'x of cp1':>8} {'sent KiB/layer':>14} {'formula':>9} {'s':>6}")
    for r in results:
        ref = base.get(r["seq"])
        r["saved_ratio"] = r["saved_max"] / ref["saved_max"] if ref else None
        r["rss_ratio"] = r["peak_rss_max"] / ref["peak_rss_max"] if ref and ref["peak_rss_max"] else None
        print(f"{r['cp']:>3} {r['mode']:>10} {r['seq']:>6} {r['saved_max'] / 2**20:>10.1f} "
              f"{r['saved_ratio'] or 0:>8.3f} {1 / r['cp']:>5.2f} {r['peak_rss_max'] / 2**20:>12.1f} "
              f"{r['rss_ratio'] or 0:>8.3f} {r['sent_per_layer'] / 2**10:>14.0f} "
              f"{r['formula_per_layer'] / 2**10:>9.0f} {r['seconds']:>6.1f}")
    with open(args.json, "w") as handle:
        json.dump({"rows": results, "model": dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB),
                   "machine": "2-core CPU sandbox shared with other jobs, gloo", "torch": torch.__version__},
                  handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
