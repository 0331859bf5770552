"""The combined layouts of ``combined.py`` at 4 processes: each trains ``COMBINED_STEPS`` AdamW steps against
single-process ``transformers`` built from the same checkpoint (the loss of every step, every local parameter after
them; ``tests/helpers/composition.py``), all in ONE spawned group of 4 gloo ranks, one saved checkpoint per family
(Llama, Mixtral). The 8-process ones (the 2D grid with data parallelism) train in ``test_eight_ranks.py``'s group.

Tolerances (``tests/helpers/composition.py``): fp32 1e-5. bf16 and fp16 layouts run the reference under the same
``torch.autocast`` (fp16: each side with its own ``GradScaler``, the parallel one's skip decision synchronised by
``training.sync_overflow``), so both round the same operands to the same dtype; what differs is the order partial
sums are reduced in (tp's row-parallel all-reduce, ZeRO's reduce-scatter of gradients, cp's chunked attention), an
error of a few units in the last place of the low-precision type: losses 2e-2 (bf16, 8 mantissa bits: 2^-8 = 4e-3
relative per rounding, a few roundings deep) and 2e-3 (fp16, 11 bits), parameters 2e-3 absolute after 3
AdamW steps of lr 1e-3 (AdamW moves an element whose gradient is at the dtype's rounding level by ~lr per step either
way: up to 2 x lr apart, seen once at fp16; a missing, doubled or unreduced gradient moves whole tensors by more,
and an axis left out entirely fails the loss check first).

Compile: ``torch.compile(backend="aot_eager")``, the cheapest backend that still runs our compile path end to end
(dynamo traces the parallel layers' collectives and the checkpointed blocks, AOTAutograd builds the joint
forward/backward graph) without inductor's C++ code generation, which a CPU CI box would pay for in minutes.
"""
from __future__ import annotations

import pytest
import torch

from oslo_models.composition.table import representative
from tests.composition.combined import COMBINED_STEPS, combined_cells
from tests.helpers.composition import train_layout
from tests.helpers.dist import run_distributed


def save_checkpoints(cells, root) -> dict[str, str]:
    """One saved ``transformers`` checkpoint per family the cells train (seed 0)."""
    folders = {}
    for model_type in sorted({c.model_type for c in cells}):
        model_class, config = representative(model_type)
        torch.manual_seed(0)
        folders[model_type] = str(root / model_type)
        model_class.hf_twin(config).save_pretrained(folders[model_type])
    return folders


def train_cells(cells, folders: dict[str, str], steps: int) -> None:
    """Every rank: train each cell's layout in turn (one error names the layout)."""
    for c in cells:
        try:
            train_layout(c.layout, representative(c.model_type)[0], folders[c.model_type], steps=steps)
        except Exception as error:
            raise AssertionError(f"{c.name} ({c.layout.describe()}, {c.model_type}): {error}") from error


@pytest.mark.parametrize("half", [0, 1])
def test_combined_layouts_match_transformers(tmp_path, half):
    """Every other layout per test, so the two halves can run on both pytest workers (about 3-4 minutes each on
    the 2-core CI box, the compiled layouts being the slow ones)."""
    cells = combined_cells(4)
    assert all(c.status == "composes" for c in cells), [(c.name, c.reason) for c in cells if c.status != "composes"]
    assert {c.layout.world_size for c in cells} == {4}
    cells = sorted(cells, key=lambda c: c.layout.compile)[half::2]  # three compiled layouts in each half
    run_distributed(train_cells, 4, cells, save_checkpoints(cells, tmp_path), COMBINED_STEPS, timeout=900)
