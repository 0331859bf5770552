"""Each tensor-parallel primitive against its single-device reference built from the same full weights, with a
negative control showing that a wrong split would fail the same check."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import oslo_models as om
from oslo_models.parallel_layers.cross_entropy import vocab_parallel_cross_entropy
from oslo_models.parallel_layers.layers import Embedding, LayerNorm, Linear
from oslo_models.parallel_layers.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from oslo_models.parallel_layers.plan import Colwise, Rowwise, SequenceParallelNorm, VocabEmbedding
from oslo_models.parallel_layers.sharding import REPLICATED, EvenSplit, Layout, PackedSplit, VocabSplit
from tests.helpers.dist import run_distributed


def _shard(spec: Layout, full: torch.Tensor, ctx) -> torch.Tensor:
    return spec.read_shard(tuple(full.shape), lambda index: full[index], ctx.tp_rank, ctx.tp_size)


def _build(style, plain, ctx):
    """Parallel layer from ``plain`` with this rank's slices of ``plain``'s weights."""
    layer = style.build(plain, ctx)
    specs = style.shard_specs(layer)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(_shard(specs.get(name, REPLICATED), getattr(plain, name), ctx))
    return layer, specs


def _linear_pair_worker(layout: str, sp: bool) -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=sp))
    torch.manual_seed(0)
    fc1, fc2 = Linear(6, 12, layout=layout), Linear(12, 5, layout=layout)
    for layer in (fc1, fc2):
        torch.nn.init.normal_(layer.weight), torch.nn.init.normal_(layer.bias)
    x = torch.randn(2, 4, 6, requires_grad=True)
    expected = fc2(torch.tanh(fc1(x)))
    expected.square().sum().backward()

    col, col_specs = _build(Colwise(), fc1, ctx)
    row, row_specs = _build(Rowwise(), fc2, ctx)
    x_local = x.detach().clone().requires_grad_(True)
    inp = scatter_to_sequence_parallel_region(x_local, ctx.tp_group) if sp else x_local
    out = row(torch.tanh(col(inp, sequence_parallel=sp)), sequence_parallel=sp)
    if sp:
        out = gather_from_sequence_parallel_region(out, ctx.tp_group, grad_is_partial=False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    torch.testing.assert_close(x_local.grad, x.grad, atol=1e-5, rtol=1e-5)
    for layer, plain, specs in ((col, fc1, col_specs), (row, fc2, row_specs)):
        for name, param in layer.named_parameters():
            expected_grad = _shard(specs.get(name, REPLICATED), getattr(plain, name).grad, ctx)
            torch.testing.assert_close(param.grad, expected_grad, atol=1e-5, rtol=1e-5)
    # Negative control: adding the row-parallel bias on every rank (before the reduction) is off by (tp-1)*b.
    wrong = out.detach() + fc2.bias.detach()
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_column_row_linear_conv1d_layout():
    run_distributed(_linear_pair_worker, 2, "conv1d", False)


def test_column_row_linear_sequence_parallel():
    run_distributed(_linear_pair_worker, 2, "linear", True)


def _packed_qkv_worker() -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    torch.manual_seed(0)
    full = torch.randn(8, 3 * 8)  # Conv1D [in, q|k|v]
    packed = PackedSplit(1, (1, 1, 1))
    local = _shard(packed, full, ctx)
    q, k, v = full.chunk(3, dim=1)
    rank = ctx.tp_rank
    expected = torch.cat([t[:, rank * 4:(rank + 1) * 4] for t in (q, k, v)], dim=1)
    assert torch.equal(local, expected)  # this rank's heads of q, of k and of v
    assert torch.equal(packed.gather(local, ctx.tp_group), full)  # gather(shards) is the original, exactly
    naive = _shard(EvenSplit(1), full, ctx)
    assert not torch.equal(naive, local)  # negative control: a plain column split takes whole blocks of q|k

    # Colwise(num_packed=3, gather_output=True): the gathered output is q|k|v in the plain layer's order, and the
    # backward gives the plain layer's input gradient and this rank's slice of its weight gradient.
    plain = Linear(8, 24, layout="conv1d")
    with torch.no_grad():
        plain.weight.copy_(full), torch.nn.init.normal_(plain.bias)
    layer, specs = _build(Colwise(num_packed=3, gather_output=True), plain, ctx)
    x = torch.randn(2, 3, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, expected_out = layer(x), plain(x_ref)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-6)
    out.pow(2).sum().backward(), expected_out.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, _shard(specs[name], getattr(plain, name).grad, ctx), atol=1e-5,
                                   rtol=1e-5)
    # Negative control: the same local weights in an unpacked gathering layer come out in rank-major order.
    unpacked, _ = _build(Colwise(gather_output=True), plain, ctx)
    with torch.no_grad():
        unpacked.weight.copy_(layer.weight), unpacked.bias.copy_(layer.bias)
    assert not torch.allclose(unpacked(x_ref), expected_out, atol=1e-3)


def test_packed_qkv_split_per_head_group():
    run_distributed(_packed_qkv_worker, 2)


def _vocab_worker(vocab: int) -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=4))
    torch.manual_seed(0)
    table = Embedding(vocab, 6)
    head = Linear(6, vocab, bias=False)
    emb, emb_specs = _build(VocabEmbedding(), table, ctx)
    lm, _ = _build(Colwise(vocab=True), head, ctx)
    assert emb.weight.shape[0] == -(-vocab // 4)
    ids = torch.randint(0, vocab, (3, 5))
    torch.testing.assert_close(emb(ids), table(ids), atol=0, rtol=0)
    hidden = torch.randn(3, 5, 6, requires_grad=True)
    labels = torch.randint(0, vocab, (3, 5))
    labels[0, :2] = -100
    local_logits = lm(hidden)
    torch.testing.assert_close(lm.gather(local_logits), head(hidden), atol=1e-6, rtol=1e-6)
    loss = vocab_parallel_cross_entropy(local_logits.view(15, -1), labels.view(-1), group=ctx.tp_group,
                                        vocab_start=lm.vocab_start_index).sum() / (labels != -100).sum()
    hidden_ref = hidden.detach().clone().requires_grad_(True)
    expected = F.cross_entropy(head(hidden_ref).view(15, -1), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)
    loss.backward(), expected.backward()
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, atol=1e-6, rtol=1e-5)
    full_grad = VocabSplit(0, vocab).gather(lm.weight.grad, ctx.tp_group)
    torch.testing.assert_close(full_grad, head.weight.grad, atol=1e-6, rtol=1e-5)
    # Negative control: without -inf on the padded columns their zero logits would enter the softmax.
    unmasked = torch.nn.functional.linear(hidden.detach(), lm.weight)
    bad = vocab_parallel_cross_entropy(unmasked.view(15, -1), labels.view(-1), group=ctx.tp_group,
                                       vocab_start=lm.vocab_start_index).sum() / (labels != -100).sum()
    assert not torch.allclose(bad, expected.detach(), atol=1e-4)


def test_vocab_parallel_embedding_head_and_cross_entropy_with_padding():
    run_distributed(_vocab_worker, 4, 13)  # 13 rows over 4 ranks: 4+4+4+1, padded to 16


def _sequence_parallel_norm_worker() -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True))
    torch.manual_seed(0)
    plain = LayerNorm(6)
    torch.nn.init.normal_(plain.weight), torch.nn.init.normal_(plain.bias)
    norm, _ = _build(SequenceParallelNorm(), plain, ctx)
    x = torch.randn(2, 4, 6)
    plain(x).pow(3).sum().backward()
    local = scatter_to_sequence_parallel_region(x, ctx.tp_group)
    norm(local, sequence_parallel=True).pow(3).sum().backward()
    torch.testing.assert_close(norm.weight.grad, plain.weight.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.bias.grad, plain.bias.grad, atol=1e-5, rtol=1e-5)
    # reduce-scatter then all-gather is a sum over ranks of identical inputs: tp * x
    summed = gather_from_sequence_parallel_region(reduce_scatter_to_sequence_parallel_region(x, ctx.tp_group),
                                                  ctx.tp_group, grad_is_partial=False)
    torch.testing.assert_close(summed, x * dist.get_world_size(), atol=0, rtol=0)


def test_sequence_parallel_norm_sums_partial_grads():
    run_distributed(_sequence_parallel_norm_worker, 2)
