"""MoE building blocks on one process: the capacity router drops exactly the tokens ``transformers``' Switch router
drops (top-1, capacity per sequence, first come first served), and dispatch -> stacked experts -> combine with
dropped assignments equals a per-token loop (dropped assignments contribute nothing), gradients included; the
dropless grouped expert run equals the padded one and each expert alone, and compiles as one custom op."""
from __future__ import annotations

import pytest
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


def _experts(kind: str):
    from oslo_models.parallel_layers.moe.clamped_experts import ClampedSwigluExperts
    from oslo_models.parallel_layers.moe.experts import StackedDenseExperts

    torch.manual_seed(0)
    experts = {"swiglu": lambda: StackedExperts(EXPERTS, HIDDEN, 8),
               "clamped": lambda: ClampedSwigluExperts(EXPERTS, HIDDEN, 8, alpha=1.702, limit=0.5),
               "dense": lambda: StackedDenseExperts(EXPERTS, HIDDEN, 8, act="relu")}[kind]()
    for param in experts.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return experts


def _run(experts, rows, counts, implementation: str):
    experts.expert_implementation = implementation
    out = experts(rows, counts)
    return out, torch.autograd.grad(out.square().sum(), [rows, *experts.parameters()])


@pytest.mark.parametrize("kind", ["swiglu", "clamped", "dense"])
def test_grouped_equals_padded_and_per_expert_loop(kind):
    """Dropless grouped experts (one grouped matmul per projection over rows sorted by expert; an expert with no
    rows; 11 rows, not a power of two) equal the padded ``torch.bmm`` path and each expert run alone, forward and
    every gradient (fp32, 1e-5). Negative control: the same rows in another expert order under the same split
    sizes give other outputs."""
    experts = _experts(kind)
    counts = torch.tensor([3, 0, 6, 2])
    rows = torch.randn(11, HIDDEN, requires_grad=True)
    grouped, grouped_grads = _run(experts, rows, counts, "grouped")
    padded, padded_grads = _run(experts, rows, counts, "padded")
    torch.testing.assert_close(grouped, padded, atol=1e-5, rtol=1e-5)
    for got, ref in zip(grouped_grads, padded_grads, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert padded_grads[-1].abs().sum() > 0 and all(g.shape == p.shape for g, p in
                                                    zip(grouped_grads[1:], experts.parameters()))
    # each expert alone: a padded run on one expert's rows (the other experts' counts 0)
    experts.expert_implementation = "padded"
    alone = []
    for expert, block in enumerate(torch.split(rows.detach(), counts.tolist())):
        only = torch.zeros_like(counts)
        only[expert] = block.shape[0]
        alone.append(experts(block, only))
    torch.testing.assert_close(grouped, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # negative control: rows in reversed expert order, split sizes listed for that order
    blocks = list(torch.split(rows.detach(), counts.tolist()))
    experts.expert_implementation = "grouped"
    wrong = experts(torch.cat(blocks[::-1]), counts.flip(0))
    unreversed = torch.cat(list(torch.split(wrong, counts.flip(0).tolist()))[::-1])
    assert not torch.allclose(unreversed, grouped, atol=1e-3)


def test_grouped_mm_compiles_without_graph_breaks():
    """The CPU grouped matmul is one custom op (``oslo_models::grouped_mm``) with a fake and autograd: a compiled
    forward and backward (``aot_eager``, ``fullgraph=True``) equals eager."""
    from oslo_models.parallel_layers.moe import grouped_mm

    weight = torch.randn(EXPERTS, HIDDEN, 5, requires_grad=True)
    rows = torch.randn(9, HIDDEN, requires_grad=True)
    counts = torch.tensor([4, 0, 2, 3])

    def step(rows, weight, counts):
        return grouped_mm(rows, weight, counts).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)  # a graph break raises
    results = []
    for fn in (step, compiled):
        loss = fn(rows, weight, counts)
        results.append((loss, torch.autograd.grad(loss, [rows, weight])))
    (loss, grads), (loss_c, grads_c) = results
    torch.testing.assert_close(loss_c, loss)
    for got, ref in zip(grads_c, grads, strict=True):
        torch.testing.assert_close(got, ref)
