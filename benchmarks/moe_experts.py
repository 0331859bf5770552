"""Expert parameter memory per rank and all-to-all bytes per layer at expert_parallel_size 1/2/4, for each MoE type.

    python benchmarks/moe_experts.py [--json benchmarks/moe_experts.json] [--tokens 4096]

Published sizes of one checkpoint per type (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, DeepSeek-V3,
gpt-oss-20b and gpt-oss-120b), bf16. No weights are allocated:

1. Memory: each layer's feed-forward is built on the meta device by the family's own ``build_mlp`` (this project's
   component, so the shapes are the model's: stacked experts with their biases, shared experts, dense layers); the
   experts' tensors (``experts.weight_names``, the part ``ExpertParallel`` splits over ``ep``) are summed over the
   sparse layers and divided by ``ep`` (each rank holds ``E/ep`` experts). The rest of the feed-forward (router,
   shared experts, dense MLPs) is replicated over ``ep`` and shown beside it.
2. All-to-all bytes: ``--tokens`` tokens of one rank are routed uniformly at random (``top_k`` distinct experts
   each), the real ``dispatch`` groups them by expert, and the rows whose expert lives on another rank (contiguous
   blocks of ``E/ep``) are counted: bytes = rows x hidden x 2 (bf16), once in dispatch and once in combine, per layer
   and forward (the backward moves the same again). Formula for uniform routing:
   ``tokens x top_k x hidden x 2 x (ep - 1) / ep`` per direction.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BYTES = 2  # bf16
EP_SIZES = (1, 2, 4)
# model type -> (checkpoint, config values): the published sizes that matter here
MODELS = {
    "mixtral": ("Mixtral-8x7B", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32,
                                     num_key_value_heads=8)),
    "qwen2_moe": ("Qwen1.5-MoE-A2.7B", dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                            shared_expert_intermediate_size=5632, num_hidden_layers=24,
                                            num_experts=60, num_experts_per_tok=4, num_attention_heads=16,
                                            num_key_value_heads=16)),
    "qwen3_moe": ("Qwen3-30B-A3B", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_experts=128, num_experts_per_tok=8,
                                        num_attention_heads=32, num_key_value_heads=4, head_dim=128)),
    "deepseek_v3": ("DeepSeek-V3", dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                                        num_hidden_layers=61, n_routed_experts=256, n_shared_experts=1,
                                        num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
                                        num_attention_heads=128, num_key_value_heads=128)),
    "gpt_oss": ("gpt-oss-20b", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64,
                                    num_key_value_heads=8, head_dim=64)),
    "gpt_oss ": ("gpt-oss-120b", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                                      num_local_experts=128, num_experts_per_tok=4, num_attention_heads=64,
                                      num_key_value_heads=8, head_dim=64)),
}


def _feed_forward_bytes(model_type: str, values: dict) -> tuple[int, int, int, int, int]:
    """(expert bytes over all sparse layers, other feed-forward bytes, sparse layers, experts, top_k)."""
    import transformers

    from oslo_models.models.registry import family_record

    record = family_record(model_type)
    config = transformers.AutoConfig.for_model(model_type, **values)
    owner = record.model_class("causal_lm")
    experts_bytes = other_bytes = sparse = 0
    num_experts = top_k = 0
    with torch.device("meta"):
        for layer in range(config.num_hidden_layers):
            mlp = owner.build_mlp(config, layer)
            total = sum(p.numel() for p in mlp.parameters()) * BYTES
            experts = getattr(mlp, "experts", None)
            if experts is None:
                other_bytes += total
                continue
            sparse += 1
            own = sum(getattr(experts, name).numel() for name in experts.weight_names) * BYTES
            experts_bytes, other_bytes = experts_bytes + own, other_bytes + total - own
            num_experts, top_k = experts.num_experts, config.num_experts_per_tok
    return experts_bytes, other_bytes, sparse, num_experts, top_k


def _sent_rows(num_experts: int, top_k: int, tokens: int, ep: int, seed: int = 0) -> int:
    """Rows rank 0 sends to other ranks in one dispatch: uniform top-k routing, grouped by the real ``dispatch``."""
    from oslo_models.parallel_layers.moe import dispatch

    generator = torch.Generator().manual_seed(seed)
    index = torch.rand(tokens, num_experts, generator=generator).topk(top_k, dim=-1).indices
    routed = dispatch(torch.zeros(tokens, 1), index, num_experts, None)  # ep = 1: rows grouped by expert
    per_rank = routed.local_counts.view(ep, num_experts // ep).sum(1)  # rows for each destination rank
    return int(per_rank[1:].sum())


def run(tokens: int) -> list[dict]:
    rows = []
    for model_type, (checkpoint, values) in MODELS.items():
        model_type = model_type.strip()
        experts_bytes, other_bytes, sparse, num_experts, top_k = _feed_forward_bytes(model_type, values)
        hidden = values["hidden_size"]
        for ep in EP_SIZES:
            sent = _sent_rows(num_experts, top_k, tokens, ep)
            formula = tokens * top_k * hidden * BYTES * (ep - 1) / ep
            rows.append(dict(model_type=model_type, checkpoint=checkpoint, ep=ep, experts=num_experts, top_k=top_k,
                             sparse_layers=sparse, expert_gib_per_rank=experts_bytes / ep / 2 ** 30,
                             other_ffn_gib=other_bytes / 2 ** 30,
                             all_to_all_mib_per_layer=2 * sent * hidden * BYTES / 2 ** 20,
                             formula_mib_per_layer=2 * formula / 2 ** 20))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--json", default=None)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank and step")
    args = parser.parse_args()
    rows = run(args.tokens)
    print(f"bf16, {args.tokens} tokens per rank; all-to-all = dispatch + combine of one layer's forward, bytes that "
          "leave the rank (measured | uniform formula)")
    print(f"{'type':<12} {'checkpoint':<18} {'ep':>2} {'E':>4} {'k':>2} {'sparse':>6} {'experts GiB/rank':>17} "
          f"{'other FFN GiB':>13} {'a2a MiB/layer':>13} {'formula':>8}")
    for r in rows:
        print(f"{r['model_type']:<12} {r['checkpoint']:<18} {r['ep']:>2} {r['experts']:>4} {r['top_k']:>2} "
              f"{r['sparse_layers']:>6} {r['expert_gib_per_rank']:>17.2f} {r['other_ffn_gib']:>13.2f} "
              f"{r['all_to_all_mib_per_layer']:>13.1f} {r['formula_mib_per_layer']:>8.1f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"tokens_per_rank": args.tokens, "dtype": "bf16", "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
