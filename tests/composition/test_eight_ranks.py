"""The four- and five-axis layouts at 8 processes (``composition.table.MULTI_AXIS``): each composing one trains 5
AdamW steps against single-process ``transformers`` (every loss, every local parameter after them;
``tests/helpers/composition.py``), all in one spawned group of 8 gloo ranks. The refused ones (their reasons are in
``docs/composition.md``) must be refused before any process group, which ``test_refused_before_any_group`` checks.
"""
from __future__ import annotations

import pytest
import torch

from oslo_models.composition.check import check_layout
from oslo_models.composition.table import multi_axis, representative
from tests.helpers.composition import train_layout
from tests.helpers.dist import run_distributed


def _train(cells, folders: dict[str, str]) -> None:
    for cell in cells:
        try:
            train_layout(cell.layout, representative(cell.model_type)[0], folders[cell.model_type])
        except Exception as error:
            raise AssertionError(f"{cell.name} ({cell.layout.describe()}): {error}") from error


def test_multi_axis_layouts_match_transformers(tmp_path):
    cells = [c for c in multi_axis() if c.status == "composes"]
    assert len(cells) >= 6 and {c.layout.world_size for c in cells} == {8}
    folders = {}
    for model_type in {c.model_type for c in cells}:
        model_class, config = representative(model_type)
        torch.manual_seed(0)
        folders[model_type] = str(tmp_path / model_type)
        model_class.hf_twin(config).save_pretrained(folders[model_type])
    run_distributed(_train, 8, cells, folders, timeout=900)  # 7 layouts x 5 steps on 8 ranks of 2 cores


def test_refused_before_any_group():
    refused = [c for c in multi_axis() if c.status == "refused"]
    assert {c.name for c in refused} == {"ep x cp x tp"}
    for c in refused:
        model_class, config = representative(c.model_type)
        with pytest.raises((ValueError, NotImplementedError), match="not implemented"):
            check_layout(c.layout, model_class, config)
