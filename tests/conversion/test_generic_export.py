"""The distributed Hub export of generic models (``transformers``' own classes): dots1 with its experts split over
``ep 2`` inside dp 4 (ZeRO-0 and ZeRO-3: DTensors over the ep / edp mesh; its fused ``gate_up_proj`` is converted
per expert by ``transformers`` on save, so it is gathered over its mesh and converted by one rank) and granite at
tp2 x dp2 ZeRO-3 (DTensors over tp and dp). After one AdamW step, plain ``transformers`` loads the folder to exactly
the tensors of the gathering save, which are not the starting ones."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models import training
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed


def _worker(paths: dict, root: str) -> None:
    import transformers

    for name, options in (("dots1", dict(data_parallel_size=4, expert_parallel_size=2, zero_stage=0)),
                          ("dots1", dict(data_parallel_size=4, expert_parallel_size=2, zero_stage=3)),
                          ("granite", dict(tensor_parallel_size=2, zero_stage=3))):
        label = f"{name}-zero{options['zero_stage']}"
        breadcrumb(label)
        model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=om.ParallelConfig(**options)).train()
        model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ctx = training.unwrap_model(model).parallel_context
        ids = torch.randint(1, 100, (8, 8), generator=torch.Generator().manual_seed(1)).chunk(ctx.dp_size)[ctx.dp_rank]
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step(), opt.zero_grad()
        new, old = os.path.join(root, label + "-new"), os.path.join(root, label + "-old")
        training.save_pretrained(model, new)
        training.save_pretrained(model, old, distributed=False)
        if dist.get_rank() == 0:
            load = transformers.AutoModelForCausalLM.from_pretrained
            saved, gathered, start = (load(p).state_dict() for p in (new, old, paths[name]))
            assert saved.keys() == gathered.keys()
            for key, value in saved.items():
                assert value.dtype == gathered[key].dtype and torch.equal(value, gathered[key]), (label, key)
            assert any(not torch.equal(saved[k], start[k]) for k in saved), label
        dist.barrier()
        del model, opt


def test_generic_distributed_export(tmp_path):
    paths = save(tmp_path / "models", {"dots1": 0, "granite": 0})
    run_distributed(_worker, 4, paths, str(tmp_path), timeout=900)
