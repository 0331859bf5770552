"""The four- and five-axis layouts at 8 processes (``composition.table.MULTI_AXIS``): each composing one trains 3
AdamW steps (``COMBINED_STEPS``, as the combined layouts: the step after the first already runs on AdamW's state)
against single-process ``transformers`` (every loss, every local parameter after them;
``tests/helpers/composition.py``), all in one spawned group of 8 gloo ranks, which then trains the 8-process combined
layouts of ``combined.py`` (the 2D grid with data parallelism, ZeRO 1-3, offload, mixed precision, checkpointing,
compile; 3 steps each too, tolerances in ``test_combined.py``). The refused ones (their reasons are in
``docs/composition.md``) must be refused before any process group, which ``test_refused_before_any_group`` checks.
"""
from __future__ import annotations

import pytest
import torch

from oslo_models.composition.check import check_layout
from oslo_models.composition.table import multi_axis, representative
from tests.composition.combined import COMBINED_STEPS, combined_cells
from tests.composition.test_combined import train_cells
from tests.helpers.dist import run_distributed


def _train(cells, combined, folders: dict[str, str]) -> None:
    train_cells(cells + combined, folders, COMBINED_STEPS)


def test_multi_axis_layouts_match_transformers(tmp_path):
    cells = [c for c in multi_axis() if c.status == "composes"]
    combined = combined_cells(8)
    assert len(cells) >= 6 and {c.layout.world_size for c in cells + combined} == {8}
    assert all(c.status == "composes" for c in combined)
    folders = {}
    for model_type in {c.model_type for c in cells + combined}:
        model_class, config = representative(model_type)
        torch.manual_seed(0)
        folders[model_type] = str(tmp_path / model_type)
        model_class.hf_twin(config).save_pretrained(folders[model_type])
    run_distributed(_train, 8, cells, combined, folders, timeout=1200)  # 10 layouts x 3 steps, 8 ranks on 2 cores


def test_refused_before_any_group():
    refused = [c for c in multi_axis() if c.status == "refused"]
    assert {c.name for c in refused} == set()  # "ep x cp x tp" composes since cp x ep was lifted (issue 52)
    for c in refused:
        model_class, config = representative(c.model_type)
        with pytest.raises((ValueError, NotImplementedError), match="not implemented"):
            check_layout(c.layout, model_class, config)
