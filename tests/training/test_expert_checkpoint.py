"""Resumable training checkpoints with experts split over ``expert_parallel_size=2`` (Mixtral): saved at step 2 and
resumed, step 3 equals the uninterrupted run (to the rounding of the gradient reduction's grouping) at ep 2 x edp 2
with ZeRO-1 (optimizer state of dense parameters sharded over dp, of experts over edp), with ZeRO-3 (FSDP2: experts
sharded over edp, the rest over dp), and at ep 2 x tp 2; the ep 2 x tp 2 checkpoint also resumes at ep 4 (experts
and their Adam moments re-split by DCP), whose step 3 equals the uninterrupted run to float tolerance. The steps use
the language-model loss on unpadded batches, equal for every dp split (the load-balancing loss is a per-rank
quantity: its parity is in tests/models/test_moe_parity.py). One spawned group of 4."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models.training import load_checkpoint, save_checkpoint, shard_data_parallel
from tests.helpers.dist import run_distributed
from tests.helpers.models import tp_local
from tests.models.test_moe_parity import ADAMW, CONFIGS, HF, VOCAB


def _build(path: str, ep: int, tp: int, zero_stage: int):
    model = om.AutoModelForCausalLM.from_pretrained(
        path, parallel=om.ParallelConfig(expert_parallel_size=ep, tensor_parallel_size=tp), progress=False).train()
    return shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW), zero_stage=zero_stage)


def _step(model, optimizer, step: int) -> None:
    """One AdamW step on this dp rank's share of global batch ``step`` (4 unpadded sequences, language-model loss
    only), so that every layout computes the same global loss (the load-balancing loss is per rank)."""
    ctx = getattr(model, "module", model).parallel_context
    ids = torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(step))
    local = ids.chunk(ctx.dp_size)[ctx.dp_rank]
    model(local, labels=local, output_router_logits=False).loss.backward()
    optimizer.step(), optimizer.zero_grad()


def _full(model) -> dict | None:
    return getattr(model, "module", model).full_state_dict()


def _worker(path: str, root: str) -> None:
    for ep, tp, zero_stage in ((2, 1, 1), (2, 1, 3), (2, 2, 0)):
        folder = os.path.join(root, f"ep{ep}-tp{tp}-zero{zero_stage}")
        model, optimizer = _build(path, ep, tp, zero_stage)
        for step in range(3):
            if step == 2:
                save_checkpoint(folder, model, optimizer, step=2)
            _step(model, optimizer, step)
        expected = {name: tp_local(param.detach()).clone() for name, param in model.named_parameters()}
        if zero_stage < 2:  # full_state_dict gathers tp/ep pieces (FSDP2 models are exported by training.export)
            uninterrupted = _full(model)

        resumed, resumed_optimizer = _build(path, ep, tp, zero_stage)
        assert load_checkpoint(folder, resumed, resumed_optimizer)["step"] == 2
        _step(resumed, resumed_optimizer, 2)
        for name, param in resumed.named_parameters():
            # float rounding only: DDP rebuilds its gradient buckets after a fresh wrapper's first iteration, so the
            # resumed step 3 all-reduces in another grouping than the uninterrupted one (1e-9 seen)
            torch.testing.assert_close(tp_local(param.detach()), expected[name], atol=1e-7, rtol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")
    # the last checkpoint (ep 2 x tp 2) at ep 4: DCP re-splits the experts and their optimizer state
    other, other_optimizer = _build(path, 4, 1, 0)
    info = load_checkpoint(folder, other, other_optimizer)
    assert info["layout"]["ep"] == 2 and not info["same_layout"]
    _step(other, other_optimizer, 2)
    resumed_full = _full(other)
    if dist.get_rank() == 0:
        assert resumed_full.keys() == uninterrupted.keys()
        for key, value in uninterrupted.items():
            torch.testing.assert_close(resumed_full[key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def test_expert_parallel_checkpoint_resumes(tmp_path):
    torch.manual_seed(0)
    HF["mixtral"](CONFIGS["mixtral"]()).save_pretrained(tmp_path / "mixtral")
    run_distributed(_worker, 4, str(tmp_path / "mixtral"), str(tmp_path), timeout=300)
