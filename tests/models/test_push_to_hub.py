"""``push_to_hub`` under TP: rank 0 uploads exactly what ``save_pretrained`` writes, the other ranks wait, and an
upload error reaches every rank instead of leaving them blocked. The Hub is replaced by a recording fake."""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.fake_hub import CopyingHub
from tests.helpers.models import padded_batch, save_tiny_gpt2


def _push_worker(source: str, target: str) -> None:
    model = om.AutoModelForCausalLM.from_pretrained(source, parallel=om.ParallelConfig(tensor_parallel_size=2),
                                                    progress=False)
    rank = torch.distributed.get_rank()
    with mock.patch("huggingface_hub.HfApi", CopyingHub(os.path.join(target, f"rank{rank}"))):
        result = model.push_to_hub("me/tiny")
    assert (result == "uploaded me/tiny") == (rank == 0)
    with mock.patch("huggingface_hub.HfApi", CopyingHub(target, fail=True)):
        with pytest.raises((ConnectionError, RuntimeError), match="hub unreachable"):
            model.push_to_hub("me/tiny")


def test_push_to_hub_uploads_from_rank0_only(tmp_path):
    source = save_tiny_gpt2(tmp_path / "src")
    run_distributed(_push_worker, 2, source, str(tmp_path / "hub"))
    assert sorted(os.listdir(tmp_path / "hub")) == ["rank0"]
    uploaded = tmp_path / "hub" / "rank0" / "me--tiny"
    ids, mask, _ = padded_batch(101)
    plain = transformers.GPT2LMHeadModel.from_pretrained(uploaded)
    reference = transformers.GPT2LMHeadModel.from_pretrained(source)
    torch.testing.assert_close(plain(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)
