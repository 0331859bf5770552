"""The sharding layouts (``parallel_layers/sharding.py``) on simulated ranks: every layout's pieces, read rank by rank
from a full tensor, join back to exactly that tensor; the packed, interleaved, head and vocabulary layouts put the
right rows on each rank; a deliberately wrong split fails the same checks. One 2-process run checks that
``gather`` / ``gather_local`` (all-gather, then ``join``) agree with the simulated ``join``."""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.parallel_layers.sharding import (
    REPLICATED,
    EvenSplit,
    GridBlock,
    HeadSplit,
    InterleavedSplit,
    PackedSplit,
    VocabSplit,
    split_layout,
)
from tests.helpers.dist import run_distributed


def _pieces(layout, full: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Rank by rank, each rank's piece read through the layout's reader (no processes)."""
    return [layout.read_shard(tuple(full.shape), lambda index: full[index], rank, size) for rank in range(size)]


def _full(rows: int = 24, cols: int = 5) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)


# One case per layout: (layout, full tensor, sizes it splits over).
CASES = {
    "replicated": (REPLICATED, _full(), (2, 3, 4)),
    "even_rows": (EvenSplit(0), _full(), (2, 3, 4)),
    "even_cols": (EvenSplit(1), _full(5, 12), (2, 3, 4)),
    "interleaved": (InterleavedSplit(1, period=2), _full(3, 24), (2, 3, 4)),
    "packed_equal": (PackedSplit(0, (1, 1, 1)), _full(36, 2), (2, 3, 4)),
    "packed_gqa": (PackedSplit(0, (8, 2, 2), heads=True), _full(36, 2), (2, 4)),
    "vocab": (VocabSplit(0, 23), _full(23, 3), (2, 3, 4)),
    "heads": (HeadSplit(0, 4), _full(12, 2), (2, 4)),
    "heads_replicated": (HeadSplit(0, 2), _full(6, 2), (2, 4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_split_then_join_is_the_original(name):
    layout, full, sizes = CASES[name]
    for size in sizes:
        pieces = _pieces(layout, full, size)
        for piece in pieces:
            assert tuple(piece.shape) == layout.local_shape(tuple(full.shape), size)
            assert layout.full_shape(tuple(piece.shape), size) == tuple(full.shape)
        assert torch.equal(layout.join(pieces), full), (name, size)


def test_grid_block_split_then_join():
    full = _full(5, 12)  # 5 vocabulary rows (padded per axis), 12 columns
    layout = GridBlock(VocabSplit(0, 5, axis="tp_col"), EvenSplit(1, axis="tp_row"))
    for n, m in ((2, 2), (3, 2), (2, 4)):
        pieces = [[layout.read_shard(tuple(full.shape), lambda index: full[index], (a, b), (n, m)) for b in range(m)]
                  for a in range(n)]
        assert all(tuple(p.shape) == layout.local_shape((5, 12), (n, m)) for row in pieces for p in row)
        assert torch.equal(layout.join(pieces), full)
        # Negative control: the blocks joined with the two axes swapped are another tensor.
        if n == m:
            swapped = [[pieces[b][a] for b in range(m)] for a in range(n)]
            assert not torch.equal(layout.join(swapped), full)


@pytest.mark.parametrize("tp", [2, 4])
def test_unequal_packed_qkv_holds_the_ranks_heads(tp):
    n, n_kv, d = 8, 2, 3
    q, k, v = torch.randn(n * d, 4), torch.randn(n_kv * d, 4), torch.randn(n_kv * d, 4)  # [heads * d, hidden]
    full = torch.cat([q, k, v])
    layout = PackedSplit(0, (n, n_kv, n_kv), heads=True)
    pieces = _pieces(layout, full, tp)
    for rank, piece in enumerate(pieces):
        heads = n // tp
        kv_head = rank * n_kv // tp if tp <= n_kv else rank // (tp // n_kv)
        kv_heads = max(n_kv // tp, 1)
        expected = torch.cat([q[rank * heads * d:(rank + 1) * heads * d],
                              k[kv_head * d:(kv_head + kv_heads) * d], v[kv_head * d:(kv_head + kv_heads) * d]])
        assert torch.equal(piece, expected), rank
    assert torch.equal(layout.join(pieces), full)
    # Negative controls: read as equal blocks, or as one even split, rank 1 holds other rows.
    assert not torch.equal(_pieces(PackedSplit(0, (1, 1, 1)), full, tp)[1], pieces[1])  # GPT-2's equal q|k|v
    assert not torch.equal(_pieces(EvenSplit(0), full, tp)[1], pieces[1])


def test_interleaved_keeps_gate_and_up_paired():
    inter = 6
    gate, up = torch.randn(4, inter), torch.randn(4, inter)
    full = torch.stack([gate, up], dim=-1).reshape(4, 2 * inter)  # gate, up, gate, up, ... (gpt-oss)
    layout = InterleavedSplit(1, period=2)
    for tp in (2, 3):
        per = inter // tp
        for rank, piece in enumerate(_pieces(layout, full, tp)):
            assert torch.equal(piece[:, 0::2], gate[:, rank * per:(rank + 1) * per])
            assert torch.equal(piece[:, 1::2], up[:, rank * per:(rank + 1) * per])
    with pytest.raises(ValueError):  # 6 pairs over 4 ranks would cut a pair
        layout.local_shape(tuple(full.shape), 4)
    # Negative control: an even split of gate|up stored as two halves (not interleaved) mixes the pairs.
    halves = torch.cat([gate, up], dim=1)
    assert not torch.equal(_pieces(layout, halves, 2)[0][:, 0::2], gate[:, :3])


def test_heads_replicated_and_vocab_padding():
    full = _full(6, 2)  # 2 heads of 3 rows
    pieces = _pieces(HeadSplit(0, 2), full, 4)
    assert torch.equal(pieces[0], pieces[1]) and torch.equal(pieces[2], pieces[3])
    assert torch.equal(pieces[1], full[:3]) and torch.equal(pieces[2], full[3:])
    assert HeadSplit(0, 2).replicas(4) == 2
    with pytest.raises(ValueError):
        HeadSplit(0, 2).local_shape((6, 2), 3)
    vocab = _full(5, 2)
    pieces = _pieces(VocabSplit(0, 5), vocab, 4)  # padded to 8: 2 rows per rank, the last rank all padding
    assert torch.equal(pieces[2], torch.cat([vocab[4:], torch.zeros(1, 2)]))
    assert torch.equal(pieces[3], torch.zeros(2, 2))


@pytest.mark.parametrize("wrong", ["rank_order", "plain_split_of_packed", "dropped_replica"])
def test_wrong_split_fails_the_round_trip(wrong):
    if wrong == "rank_order":
        full, layout = _full(), EvenSplit(0)
        pieces = _pieces(layout, full, 3)[::-1]
    elif wrong == "plain_split_of_packed":
        full, layout = _full(36, 2), PackedSplit(0, (1, 1, 1))
        pieces = _pieces(EvenSplit(0), full, 3)
    else:
        full, layout = _full(6, 2), HeadSplit(0, 2)
        pieces = _pieces(EvenSplit(0), full, 2) * 2  # rank order 0, 1, 0, 1: not consecutive replicas
    assert not torch.equal(layout.join(pieces), full)


def test_split_layout_keywords_build_the_layouts():
    assert split_layout(None) is REPLICATED
    assert split_layout(1) == EvenSplit(1)
    assert split_layout(0, num_packed=3) == PackedSplit(0, (1, 1, 1))
    assert split_layout(0, vocab_size=7, axis="tp_row") == VocabSplit(0, 7, "tp_row")
    assert split_layout(0, num_heads=2) == HeadSplit(0, 2)
    block = GridBlock(VocabSplit(0, 5, "tp_col"), EvenSplit(1, "tp_row"))
    assert (block.dim, block.axis, block.dim2, block.axis2) == (0, "tp_col", 1, "tp_row")


def _gather_worker() -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    for name, (layout, full, sizes) in CASES.items():
        if 2 not in sizes:
            continue
        local = layout.read_local(tuple(full.shape), lambda index: full[index], ctx)
        assert torch.equal(local, _pieces(layout, full, 2)[ctx.tp_rank]), name
        assert torch.equal(layout.gather_local(local, ctx), full), name
        assert torch.equal(layout.gather(local, ctx.tp_group), full), name


def test_gather_over_processes_matches_join():
    run_distributed(_gather_worker, 2)
