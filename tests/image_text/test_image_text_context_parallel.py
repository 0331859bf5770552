"""Image-text models at cp 2 x dp 2 train exactly like single-process ``transformers``
(``image_text/context_parallel.py``).

One spawned group of 4 gloo processes. Each type loaded with ``om.AutoModelForImageTextToText`` from a saved Hub
folder; the 4-row image-text batch of ``batches.py`` (prompt and image tokens masked, rows with different label
counts, right padding to a length 2 cp divides), data-parallel rank ``d`` taking rows ``d::2`` whole and their images,
its labels split into the cp rank's chunk(s) by ``om.image_text.context_parallel_splitter`` (shifted on the whole
sequence first). In the LLaVA, Qwen2.5-VL ring and Qwen3-VL cases some row's image tokens lie on both cp ranks
(asserted: the split runs through an image). The vision tower runs on every cp rank,
the merged sequence is split before the language model.

- LLaVA (ring, vision trained, ZeRO-3; all-to-all, frozen, ZeRO-0), Qwen2.5-VL (ring, frozen, ZeRO-1; all-to-all,
  trained, ZeRO-3: M-RoPE positions ``[3, b, S]`` computed on the whole sequence, split along it), LLaVA-NeXT and
  SmolVLM (ring, trained, ZeRO-0), Qwen3-VL (ring, trained, ZeRO-3: interleaved M-RoPE, its deepstack features
  split with the chunk), Mistral 3 (all-to-all, frozen, ZeRO-2) and Idefics3 (ring, frozen, ZeRO-0): each of 3 AdamW
  steps' loss (the chunks' shares summed over cp, averaged over dp) and every parameter after them equal the
  single-process run on the whole batch (fp32, 1e-5); frozen, the vision parameters are unchanged;
- negative controls (the losses differ from the reference's): LLaVA in ring mode given the all-to-all split of the
  labels; Qwen2.5-VL given text-only positions (``position_ids`` 0, 1, 2, ... on every axis);
- refused at load with the reason: Gemma 3 (its bidirectional image-block masks).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models import training
from oslo_models.data.collators.context_parallel import ContextParallelSplitter
from oslo_models.image_text import context_parallel_splitter
from oslo_models.parallel_layers.context_parallel.chunking import token_index
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share
from tests.image_text.batches import rows
from tests.image_text.models import IMAGE_TOKEN, save
from tests.image_text.parity import ADAMW, STEPS, TOL, reference_run

# (type, cp mode, vision frozen, ZeRO stage)
CASES = (("llava", "ring", False, 3), ("llava", "all_to_all", True, 0), ("qwen2_5_vl", "ring", True, 1),
         ("qwen2_5_vl", "all_to_all", False, 3), ("llava_next", "ring", False, 0), ("smolvlm", "ring", False, 0),
         ("qwen3_vl", "ring", False, 3), ("mistral3", "all_to_all", True, 2), ("idefics3", "ring", True, 0))
MULTIPLE = 4  # 2 x cp: the ring layout's 2 cp chunks


def padded(batch: dict) -> dict:
    """Right-pad every ``[b, s]`` tensor to a multiple of ``MULTIPLE`` (no label, masked: the loss is unchanged)."""
    seq = batch["input_ids"].shape[1]
    extra = -seq % MULTIPLE
    fill = {"labels": -100}
    return {key: torch.nn.functional.pad(value, (0, extra), value=fill.get(key, 0))
            if value.dim() == 2 and value.shape[1] == seq and key != "image_grid_thw" else value
            for key, value in batch.items()}


def _images_cross(batch, mode) -> bool:
    """Whether some row's image tokens lie on both cp ranks (the split runs through an image)."""
    seq = batch["input_ids"].shape[1]
    owner = torch.empty(seq, dtype=torch.long)
    for rank in range(2):
        owner[token_index(seq // 2, rank, 2, mode)] = rank
    return any(len(set(owner[row == IMAGE_TOKEN].tolist())) == 2 for row in batch["input_ids"])


def _train(path, name, mode, frozen, zero, batch, wrong_split=False, text_positions=False):
    parallel = om.ParallelConfig(context_parallel_size=2, data_parallel_size=2, context_parallel_mode=mode,
                                 zero_stage=zero)
    model = om.AutoModelForImageTextToText.from_pretrained(path, parallel=parallel, freeze_vision=frozen).train()
    context = model.parallel_context
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    # ZeRO-0 with the vision tower trained: LLaVA-style towers leave their last layer unused (DDP must know)
    unused = dict(find_unused_parameters=True) if zero == 0 and not frozen else {}
    model, opt = training.shard_data_parallel(model, opt, zero_stage=zero, **unused)
    inner = training.unwrap_model(model)
    local = rows(batch, slice(context.dp_rank, None, 2))
    splitter = context_parallel_splitter(context)
    if wrong_split:  # negative control: the other layout's chunks of the targets
        splitter = ContextParallelSplitter(context, mode="all_to_all", keys=("labels", "shift_labels"))
    local = with_global_share(inner, splitter(local), True)
    if text_positions:  # negative control: M-RoPE positions of text only
        ids = local["input_ids"]
        local["position_ids"] = torch.arange(ids.shape[1]).expand(3, *ids.shape)
    losses = []
    for step in range(STEPS):
        breadcrumb(f"{name} {mode} frozen={frozen} zero{zero}: step {step}")
        loss = model(**local).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=context.dp_cp_group)
        losses.append(total / context.dp_cp_size)
    return inner, torch.stack(losses)


def _worker(paths, refs):
    crossed = set()
    for name, mode, frozen, zero in CASES:
        ref = refs[name, frozen]
        batch = padded(ref["batch"])
        if _images_cross(batch, mode):
            crossed.add((name, mode))
        model, losses = _train(paths[name], name, mode, frozen, zero, batch)
        torch.testing.assert_close(losses, torch.stack(ref["losses"]), msg=lambda m: f"{name} {mode}: {m}", **TOL)
        for pname, param in model.named_parameters():
            value = param.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(value, ref["state"][pname], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=pname: f"{name} {mode} frozen={frozen} {n}: {m}")
        del model
    assert {("llava", "ring"), ("llava", "all_to_all"), ("qwen2_5_vl", "ring"), ("qwen3_vl", "ring")} <= crossed
    for name, control in (("llava", "wrong_split"), ("qwen2_5_vl", "text_positions")):
        breadcrumb(f"negative control {name} {control}")
        ref = refs[name, False]
        _, losses = _train(paths[name], name, "ring", False, 0, padded(ref["batch"]), **{control: True})
        assert (losses - torch.stack(ref["losses"])).abs().max() > 1e-4, (name, control, losses, ref["losses"])
    breadcrumb("gemma3 refused")
    with pytest.raises(NotImplementedError, match="bidirectional"):
        om.AutoModelForImageTextToText.from_pretrained(paths["gemma3"], parallel=om.ParallelConfig(
            context_parallel_size=2, data_parallel_size=2))


@pytest.mark.slow
def test_image_text_context_parallel_trains_like_transformers(tmp_path):
    names = sorted({name for name, *_ in CASES} | {"gemma3"})
    paths = save(tmp_path / "models", names)
    refs = {(name, frozen): reference_run(paths[name], name, freeze=frozen, generate=False)
            for name, _, frozen, _ in CASES}
    run_distributed(_worker, 4, paths, refs)
