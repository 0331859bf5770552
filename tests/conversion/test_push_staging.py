"""``model.push_to_hub`` writes the uploaded folder from every rank (issue 53): the same distributed writer as
``save_pretrained``, into a staging folder of global rank 0 that every rank sees; rank 0 uploads after the save.

2 ranks, tiny GPT-2 at tp 2, the Hub replaced by a recording fake (``tests/helpers/fake_hub.py``):

- both ranks write tensor bytes into the staging folder (``hub_export.write_box`` counted per rank); the negative
  control: the gathering save (``training.save_pretrained(..., distributed=False)``) under the same counter gives
  rank 1 nothing to write, so the count tells the two apart. Only rank 0 uploads; the uploaded folder is the
  checkpoint's tensors exactly in plain ``transformers``; the staging folder is removed afterwards.
- a rank that does not see rank 0's staging folder (another node's temporary folder) makes every rank raise a
  ``ValueError`` naming ``staging_dir=`` before anything is written or uploaded.
"""
from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models import training
from oslo_models.conversion import hub_export
from tests.helpers.dist import run_distributed
from tests.helpers.fake_hub import CopyingHub
from tests.helpers.models import save_tiny_gpt2


def _bytes_written_by_rank(save) -> list[int]:
    """Run ``save()`` on every rank; the tensor bytes each rank wrote through ``hub_export.write_box``."""
    counted, real = [], hub_export.write_box

    def counting(*args, **kwargs):
        counted.append(real(*args, **kwargs))
        return counted[-1]

    with mock.patch.object(hub_export, "write_box", counting):
        save()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, sum(counted))
    return out


def _worker(source: str, root: str) -> None:
    model = om.AutoModelForCausalLM.from_pretrained(source, parallel=om.ParallelConfig(tensor_parallel_size=2),
                                                    progress=False)
    rank = dist.get_rank()
    staging = os.path.join(root, "staging")
    os.makedirs(staging, exist_ok=True)
    results = []
    with mock.patch("huggingface_hub.HfApi", CopyingHub(os.path.join(root, f"hub-rank{rank}"))):
        written = _bytes_written_by_rank(lambda: results.append(model.push_to_hub("me/tiny", staging_dir=staging)))
    assert all(count > 0 for count in written), written  # every rank wrote its share of the uploaded folder
    assert (results[0] == "uploaded me/tiny") == (rank == 0)
    gathered = _bytes_written_by_rank(lambda: training.save_pretrained(model, os.path.join(root, "old"),
                                                                        distributed=False))
    assert gathered == [0, 0], gathered  # negative control: rank 0 alone writes, and not through the writer
    dist.barrier()  # rank 0 removes the staging folder once the upload is agreed
    assert os.listdir(staging) == [], [os.path.join(top, *names) for top, _, names in os.walk(staging)]
    dist.barrier()  # every rank has looked before rank 0 makes the next push's staging folder below

    # a rank blind to rank 0's staging folder: every rank refuses before writing anything
    real_isdir = os.path.isdir

    def isdir(path):
        if rank == 1 and os.path.basename(os.fspath(path)).startswith("oslo-push-"):
            return False
        return real_isdir(path)

    with mock.patch("huggingface_hub.HfApi", CopyingHub(os.path.join(root, "blind"))), \
            mock.patch.object(os.path, "isdir", isdir):
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\] do not see rank 0's staging folder .* staging_dir="):
            model.push_to_hub("me/blind", staging_dir=staging)
    dist.barrier()
    assert os.listdir(staging) == [] and not os.path.exists(os.path.join(root, "blind"))


def test_push_to_hub_writes_from_every_rank(tmp_path):
    source = save_tiny_gpt2(tmp_path / "src")
    run_distributed(_worker, 2, source, str(tmp_path))
    assert not os.path.exists(tmp_path / "hub-rank1")  # rank 1 never uploads
    uploaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hub-rank0" / "me--tiny").state_dict()
    original = transformers.GPT2LMHeadModel.from_pretrained(source).state_dict()
    assert uploaded.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(uploaded[key], value), key
