"""The composition table is generated from the validation code, and the docs page is that table."""
from __future__ import annotations

from pathlib import Path

import pytest

from oslo_models.composition import AXIS, check_layout, combine
from oslo_models.composition.table import counts, pairs, render, representative

DOCS = Path(__file__).resolve().parents[2] / "docs" / "composition.md"


def test_docs_page_is_the_generated_table():
    assert DOCS.read_text(encoding="utf-8") == render(), \
        "regenerate: python -m oslo_models.composition --write docs/composition.md"


def test_every_pair_is_decided_with_a_reason():
    cells = pairs()
    pair_cells = [c for c in cells if len(c.axes) == 2]
    assert len(pair_cells) == 17 * 16 // 2
    assert sum(counts(pair_cells).values()) == len(pair_cells)
    for c in cells:
        assert c.status in ("composes", "refused", "exclusive")
        assert (c.status == "composes") == (c.reason == ""), c
    assert {c.name for c in cells if c.status == "exclusive"} == {"tp x grid", "z1 x z2", "z1 x z3", "z2 x z3",
                                                                 "fp16 x bf16"}


def test_refusals_are_raised_without_any_process_group():
    """Every refused cell's error comes from configs alone: no process group exists while ``check_layout`` raises it
    (the table is generated from ``check_layout``, so this checks where the refusal happens, not what it says; that a
    composing cell really trains is ``test_matrix.py``'s job). A composing layout passes the same check."""
    import torch.distributed as dist

    refused = [c for c in pairs() if c.status == "refused"]
    assert refused, "nothing refused: check that the table still reads the validation code"
    assert not dist.is_initialized()
    for c in refused:
        with pytest.raises((ValueError, NotImplementedError)):
            check_layout(c.layout, *representative(c.model_type))
        assert not dist.is_initialized()
    check_layout(combine("tp", "dp"), *representative("llama"))


def test_combine_merges_sizes_and_training_options():
    layout = combine("sp", "z3")
    assert layout.parallel == {"tensor_parallel_size": 2, "sequence_parallel": True, "data_parallel_size": 2}
    assert layout.zero_stage == 3 and layout.world_size == 4
    assert combine("off", "z2").zero_stage == 2 and combine("off").zero_stage == 3
    assert combine("ep", "tp").parallel["data_parallel_size"] == 2 and combine("ep").moe
    with pytest.raises(ValueError, match="zero_stage chooses one stage"):
        combine("z1", "z2")
    assert AXIS["grid"].layout.parallel["tensor_parallel_mode"] == "2d"


def test_offload_axes_keep_a_paired_zero_stage_in_either_order():
    """``off`` and ``nvme`` mean ZeRO-3 unless paired with a ZeRO axis, whichever comes first."""
    for offload in ("off", "nvme"):
        assert combine(offload).zero_stage == 3
        for zero, stage in (("z1", 1), ("z2", 2), ("z3", 3)):
            assert combine(offload, zero).zero_stage == combine(zero, offload).zero_stage == stage, (offload, zero)
    assert combine("nvme", "z2").parallel["offload"] == "nvme" and combine("off", "z1").cpu_offload
    assert combine("off", "nvme").zero_stage == combine("nvme", "off").zero_stage == 3


def test_combine_is_order_free():
    """``combine`` of every pair and triple of the axes the module knows is the same layout in every order (or the
    same refusal)."""
    from itertools import combinations, permutations

    def outcome(names):
        try:
            return combine(*names)
        except ValueError as error:
            return str(error).split(": ", 1)[1]  # the reason, without the names' order

    for size in (2, 3):
        for names in combinations(AXIS, size):
            results = [outcome(order) for order in permutations(names)]
            assert all(r == results[0] for r in results), (names, results)
