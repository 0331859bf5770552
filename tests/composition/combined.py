"""The combined layouts CI trains: a few layouts, each turning many axes on at once, that together train every
composing cell of the table no narrower CI test trains (mixed precision, compile, activation checkpointing and the
offload tiers with the parallel axes; the grid with ZeRO).

Each layout is a tuple of the table's axis names, built by ``composition.table.cell`` (so ``check_layout`` decides
it like any cell; ``moe`` asks for the Mixtral with its experts replicated). ``test_combined.py`` trains the 4-rank
ones in one spawned group and ``test_eight_ranks.py`` the 8-rank ones (the grid is 2 x 2 = 4 tensor-parallel ranks,
x 2 data-parallel) in its group; ``coverage.py`` maps every pair of each layout's axes to the test that trains it.
"""
from __future__ import annotations

import dataclasses

from oslo_models.composition.table import Cell, cell

COMBINED_STEPS = 3  # AdamW steps per layout (the 5 of the pair matrix and the 8-rank layouts cost more CPU than CI has)

FOUR_RANKS = (
    ("sp", "z2", "nvme", "ac", "bf16", "compile"),  # tp2+sp x dp2 x ZeRO-2 + Adam state on disk x checkpointing x bf16
    #                                           x compile
    ("sp", "z1", "fp16", "compile"),          # tp2+sp x dp2 x ZeRO-1 x fp16 (scaler) x compile
    ("sp", "off", "ac"),                      # tp2+sp x dp2 x ZeRO-3 + cpu offload x checkpointing
    ("cp", "off", "bf16", "compile"),         # cp2 x dp2 x ZeRO-3 + cpu offload x bf16 x compile
    ("cp", "z2", "nvme", "fp16", "ac", "moe"),  # Mixtral: cp2 x dp2 x ZeRO-2 + disk x fp16 x checkpointing
    ("ep", "tp", "z2", "ac", "fp16", "compile"),  # Mixtral: tp2 x ep2 x dp2 x ZeRO-2 x checkpointing x fp16 x compile
    ("ep", "tp", "off", "bf16"),              # Mixtral: tp2 x ep2 x dp2 x ZeRO-3 + cpu offload x bf16 (low-precision
    #                                           MoE: the reference's routing forced, tests/helpers/forced_routing.py)
    ("pp", "nvme"),                           # pp2 x dp2 x ZeRO-3 + disk
    ("tp", "z1", "bf16"),                     # tp2 x dp2 x ZeRO-1 x bf16
    ("tp", "off", "fp16"),                    # tp2 x dp2 x ZeRO-3 + cpu offload x fp16
    ("grid", "compile", "moe"),               # Mixtral: 2D tp4 (experts replicated) x compile (with dp: 8 ranks,
    #                                           450 s here before the SUMMA collectives ran eagerly under compile;
    #                                           at 4 ranks ~2.5 min, the same with the Mixtral as with the Llama)
)
EIGHT_RANKS = (
    ("grid", "z1", "ac", "bf16"),             # 2D tp4 x dp2 x ZeRO-1 x checkpointing x bf16
    ("grid", "z2", "nvme", "fp16"),           # 2D tp4 x dp2 x ZeRO-2 + disk x fp16
    ("grid", "off"),                          # 2D tp4 x dp2 x ZeRO-3 + cpu offload
)


def combined_cell(names: tuple[str, ...]) -> Cell:
    """The table's decision for ``names`` together; with ``moe``, the layout is marked as needing the MoE model."""
    found = cell(*names)
    if "moe" in names and found.layout is not None:
        found = dataclasses.replace(found, layout=dataclasses.replace(found.layout, moe=True))
    return found


def combined_cells(world: int | None = None) -> list[Cell]:
    """The combined layouts (of ``world`` processes when given) as table cells."""
    names = {4: FOUR_RANKS, 8: EIGHT_RANKS}.get(world, FOUR_RANKS + EIGHT_RANKS) if world else FOUR_RANKS + EIGHT_RANKS
    return [combined_cell(n) for n in names]
