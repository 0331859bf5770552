"""Expert parallelism: per-rank expert memory, all-to-all bytes per layer, dropped tokens under a skewed router.

    python benchmarks/moe.py [--json moe.json]

1. Memory: a Mixtral (hidden 256, 8 experts of intermediate 512, 2 layers, vocab 1024) built with
   ``from_config`` at ``expert_parallel_size`` 1/2/4 on 4 gloo processes (dp=4); each rank sums the bytes of the
   parameters its plan splits over ``ep`` (the stacked experts) and of all its parameters. Target: expert bytes
   fall as 1/ep, the rest stays.
2. All-to-all bytes: layer 0's router routes a batch of random hidden states (2 x 128 tokens, top-2) and
   ``dispatch`` sends each assignment to its expert's rank; the bytes that leave the rank (rows sent to other
   ranks x hidden x 4 bytes) are read from the real split sizes, once for dispatch and once for combine, and set
   against the formula ``tokens x top_k x hidden x bytes x (ep - 1) / ep`` per direction (uniform routing).
   The same memory measurement for Switch Transformers (d_model 256, 8 experts of d_ff 512, 4 + 4 layers with
   2 sparse layers per stack, vocab 1024).
3. Skewed router (one process): top-1 routing with a capacity of ``ceil(cf x tokens / E)`` per expert (Switch
   token dropping) on random inputs (push 0) and on inputs whose expert-0 logit is raised by ``push`` (0.5, about
   1.5 standard deviations of a logit); reports the dropped fraction, max/mean expert load and the
   load-balancing loss (``transformers``' formula) at several capacity factors.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, EXPERTS, TOP_K, TOKENS = 256, 8, 2, 256


def _config():
    import transformers

    return transformers.MixtralConfig(vocab_size=1024, hidden_size=HIDDEN, intermediate_size=512,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)


def _switch_config():
    import transformers

    return transformers.SwitchTransformersConfig(vocab_size=1024, d_model=HIDDEN, d_kv=64, d_ff=512, num_heads=4,
                                                 num_layers=4, num_decoder_layers=4, num_sparse_encoder_layers=2,
                                                 num_sparse_decoder_layers=2, num_experts=EXPERTS,
                                                 decoder_start_token_id=0)


def _param_bytes(model) -> tuple[int, int]:
    """(bytes of the parameters split over ep, bytes of all parameters) on this rank."""
    from oslo_models.distributed.expert_parallel import expert_parameter_names

    params = dict(model.named_parameters())
    expert_bytes = sum(params[n].numel() * params[n].element_size() for n in expert_parameter_names(model))
    return expert_bytes, sum(p.numel() * p.element_size() for p in model.parameters())


def _measure(ep: int) -> dict:
    import oslo_models as om
    from oslo_models.parallel_layers.moe import dispatch

    torch.manual_seed(0)
    model = om.MixtralForCausalLM.from_config(om.MixtralConfig.from_dict(_config().to_dict()),
                                              parallel=om.ParallelConfig(expert_parallel_size=ep))
    ctx = model.parallel_context
    expert_bytes, total_bytes = _param_bytes(model)
    torch.manual_seed(0)
    switch = om.SwitchTransformersForConditionalGeneration.from_config(
        om.SwitchTransformersConfig.from_dict(_switch_config().to_dict()), parallel=ctx)
    switch_expert_bytes, switch_total_bytes = _param_bytes(switch)
    block = model.model.layers[0].mlp
    torch.manual_seed(100 + ctx.rank)  # each data-parallel rank routes its own tokens
    x = torch.randn(TOKENS, HIDDEN)
    with torch.no_grad():
        _, _, index = block.gate(x)
        routed = dispatch(x, index, EXPERTS, block.experts.group)
    me = ctx.ep_rank
    row_bytes = HIDDEN * x.element_size()
    sent = sum(n for r, n in enumerate(routed.send_splits) if r != me) * row_bytes
    returned = sum(n for r, n in enumerate(routed.recv_splits) if r != me) * row_bytes  # combine sends these back
    return {"ep": ep, "expert_bytes": expert_bytes, "total_bytes": total_bytes, "dispatch_bytes": sent,
            "combine_bytes": returned, "formula_bytes": TOKENS * TOP_K * row_bytes * (ep - 1) / ep,
            "switch_expert_bytes": switch_expert_bytes, "switch_total_bytes": switch_total_bytes}


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    results = [_measure(ep) for ep in (1, 2, 4)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "ranks.json"), "w") as handle:
            json.dump(gathered, handle)


def skewed_router(capacity_factors=(1.0, 1.25, 2.0), pushes=(0.0, 0.5), tokens: int = 4096) -> list[dict]:
    from oslo_models.parallel_layers.moe import TopKRouter, load_balancing_loss

    rows = []
    for push, cf in ((p, c) for p in pushes for c in capacity_factors):
        torch.manual_seed(0)  # the same router and tokens at every capacity factor
        capacity = math.ceil(cf * tokens / EXPERTS)
        router = TopKRouter(HIDDEN, EXPERTS, 1, normalize=False, capacity=capacity)
        torch.nn.init.normal_(router.weight, std=0.02)
        direction = router.weight[0].detach() / router.weight[0].detach().norm()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(tokens, HIDDEN, generator=gen) + push * direction / router.weight[0].detach().norm()
        with torch.no_grad():
            logits, _, index = router(x)
        wanted = torch.bincount(logits.argmax(-1), minlength=EXPERTS)
        kept = torch.bincount(index[index >= 0], minlength=EXPERTS)
        rows.append({"push_to_expert0": push, "capacity_factor": cf, "capacity": capacity, "tokens": tokens,
                     "dropped_fraction": 1 - kept.sum().item() / tokens,
                     "wanted_per_expert": wanted.tolist(), "kept_per_expert": kept.tolist(),
                     "max_over_mean_load": (wanted.max() / wanted.float().mean()).item(),
                     "load_balancing_loss": float(load_balancing_loss((logits,), EXPERTS, 1))})
    return rows


def main() -> None:
    import tempfile

    from tests.helpers.dist import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="moe.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run_distributed(_worker, 4, tmp)
        with open(os.path.join(tmp, "ranks.json")) as handle:
            per_rank = json.load(handle)
    rows = []
    for i, ep in enumerate((1, 2, 4)):
        ranks = [r[i] for r in per_rank]
        rows.append({"ep": ep, "expert_MiB_per_rank": max(r["expert_bytes"] for r in ranks) / 2**20,
                     "all_params_MiB_per_rank": max(r["total_bytes"] for r in ranks) / 2**20,
                     "dispatch_KiB_mean": sum(r["dispatch_bytes"] for r in ranks) / len(ranks) / 1024,
                     "combine_KiB_mean": sum(r["combine_bytes"] for r in ranks) / len(ranks) / 1024,
                     "formula_KiB": ranks[0]["formula_bytes"] / 1024,
                     "switch_expert_MiB_per_rank": max(r["switch_expert_bytes"] for r in ranks) / 2**20,
                     "switch_all_params_MiB_per_rank": max(r["switch_total_bytes"] for r in ranks) / 2**20,
                     "per_rank": ranks})
    base = rows[0]["expert_MiB_per_rank"]
    print(f"{'ep':>3} {'expert MiB/rank':>16} {'x ep / ep=1':>12} {'all MiB/rank':>13} {'dispatch KiB':>13} "
          f"{'combine KiB':>12} {'formula KiB':>12}")
    for r in rows:
        print(f"{r['ep']:>3} {r['expert_MiB_per_rank']:>16.3f} {r['expert_MiB_per_rank'] * r['ep'] / base:>12.3f} "
              f"{r['all_params_MiB_per_rank']:>13.3f} {r['dispatch_KiB_mean']:>13.1f} {r['combine_KiB_mean']:>12.1f} "
              f"{r['formula_KiB']:>12.1f}")
    print(f"\n{'ep':>3} {'Switch expert MiB/rank':>23} {'x ep / ep=1':>12} {'all MiB/rank':>13}")
    switch_base = rows[0]["switch_expert_MiB_per_rank"]
    for r in rows:
        print(f"{r['ep']:>3} {r['switch_expert_MiB_per_rank']:>23.3f} "
              f"{r['switch_expert_MiB_per_rank'] * r['ep'] / switch_base:>12.3f} "
              f"{r['switch_all_params_MiB_per_rank']:>13.3f}")
    skew = skewed_router()
    print(f"\n{'push':>5} {'cf':>5} {'capacity':>9} {'dropped':>8} {'max/mean load':>14} {'lb loss':>8}  "
          "wanted per expert")
    for r in skew:
        print(f"{r['push_to_expert0']:>5} {r['capacity_factor']:>5} {r['capacity']:>9} {r['dropped_fraction']:>8.3f} "
              f"{r['max_over_mean_load']:>14.2f} {r['load_balancing_loss']:>8.3f}  {r['wanted_per_expert']}")
    with open(args.json, "w") as handle:
        json.dump({"memory_and_all_to_all": rows, "skewed_router": skew, "machine": "2-core CPU sandbox, gloo",
                   "torch": torch.__version__}, handle, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
