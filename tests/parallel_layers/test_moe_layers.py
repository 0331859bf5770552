"""MoE building blocks on one process: the capacity router drops exactly the tokens ``transformers``' Switch router
drops (top-1, capacity per sequence, first come first served), and dispatch -> stacked experts -> combine with
dropped assignments equals a per-token loop (dropped assignments contribute nothing), gradients included."""
from __future__ import annotations

import torch
import transformers
from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router

from oslo_models.parallel_layers.moe import StackedExperts, TopKRouter, combine, dispatch

HIDDEN, EXPERTS = 16, 4


def test_capacity_router_drops_what_switch_drops():
    config = transformers.SwitchTransformersConfig(d_model=HIDDEN, num_experts=EXPERTS, expert_capacity=3,
                                                   router_jitter_noise=0.0)
    torch.manual_seed(0)
    reference = SwitchTransformersTop1Router(config)
    router = TopKRouter(HIDDEN, EXPERTS, 1, normalize=False, capacity=3)
    router.weight.data.copy_(reference.classifier.weight.data)
    x = torch.randn(1, 20, HIDDEN)  # 20 tokens, 4 experts of capacity 3: most tokens are dropped
    one_hot, probs, ref_logits = reference(x)
    logits, weights, index = router(x[0])
    torch.testing.assert_close(logits, ref_logits[0])
    kept = one_hot[0].sum(-1).bool()
    assert 0 < int(kept.sum()) < 20
    assert torch.equal(index[:, 0] >= 0, kept)
    assert torch.equal(index[kept, 0], one_hot[0][kept].argmax(-1))
    torch.testing.assert_close(weights[kept, 0], probs[0, kept, 0])
    assert torch.all(weights[~kept] == 0)


def test_dropping_dispatch_matches_per_token_loop():
    torch.manual_seed(0)
    experts = StackedExperts(EXPERTS, HIDDEN, 8)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    x = torch.randn(10, HIDDEN, requires_grad=True)
    index = torch.randint(0, EXPERTS, (10, 2))
    index[[1, 4, 7], [0, 1, 1]] = -1  # dropped assignments (capacity overflow)
    weights = torch.rand(10, 2, requires_grad=True)
    routed = dispatch(x, index, EXPERTS, None)
    out = combine(experts(routed.rows, routed.local_counts), routed, weights, 10, None)

    def expert(e, row):
        gate, up = (experts.gate_up_proj[e] @ row).chunk(2)
        return experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up)

    expected = torch.stack([sum((weights[t, k] * expert(int(index[t, k]), x[t]) for k in range(2)
                                 if index[t, k] >= 0), torch.zeros(HIDDEN)) for t in range(10)])
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    ref_grads = torch.autograd.grad(expected.square().sum(), [x, weights, experts.gate_up_proj, experts.down_proj])
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert torch.all(grads[1][index < 0] == 0)  # a dropped assignment's weight gets no gradient
