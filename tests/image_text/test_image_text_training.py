"""Image-text models at tp 2 x dp 2 ZeRO-3 train exactly like single-process ``transformers``.

One spawned group of 4 gloo processes runs every listed type (``models.py``: LLaVA, LLaVA-NeXT, Gemma 3, Qwen2.5-VL,
Qwen3-VL, Mistral 3, Idefics3, SmolVLM), loaded with ``om.AutoModelForImageTextToText`` from a saved Hub folder, on
an image-text batch of 4 rows (``batches.py``: prompt and image tokens masked, rows with different label counts,
right padding), data-parallel rank ``d`` taking rows ``d::2`` and their images. For each type:

- ``generate`` with pixel values at tp 2 (before training, no ZeRO wrapping) gives ``transformers``' greedy tokens;
- vision trained and frozen (``freeze_vision=True``), each type in both modes: the step-0 logits and every
  step-0 gradient (gathered over tp and dp; ``None`` for the frozen vision side), and each step's loss (the dp mean)
  equal the single-process run on the whole batch (fp32, 1e-5), 3 AdamW steps. Frozen: the vision parameters have no
  gradient and no optimizer state (the optimizer's state holds exactly the trainable parameters) and are unchanged;
- in the type's main mode (vision trained for ``TRAINED``, frozen for the others) then ``training.save_pretrained``
  -> plain ``transformers`` load on rank 0 -> every parameter equals the reference's and the logits of the batch
  equal the reference model's after its 3 steps;
- negative controls (no_grad, on the loaded model): the image tokens moved one position right changes the logits
  by > 1e-3; for Qwen, M-RoPE positions of text only (``position_ids`` = 0, 1, 2, ... on all three axes) too.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share
from tests.image_text.batches import QWEN, make_batch, rows
from tests.image_text.models import TYPES, save
from tests.image_text.parity import ADAMW, STEPS, TOL, reference_run

# vision trained for these, frozen for the others (each mode covered by several families)
TRAINED = ("llava", "qwen2_5_vl", "mistral3", "smolvlm")


def _control(model, name, batch, expected_logits):
    """The negative controls: misplaced image features (and Qwen's text-only positions) change the logits."""
    with torch.no_grad():
        shifted = make_batch(name, model, shift_image=1)
        got = model(**{k: v for k, v in shifted.items() if k != "labels"}).logits
        assert (got - expected_logits).abs().max() > 1e-3, name
        if name in QWEN:
            plain = {k: v for k, v in batch.items() if k != "labels"}
            positions = torch.arange(batch["input_ids"].shape[1]).expand(3, *batch["input_ids"].shape)
            got = model(**plain, position_ids=positions).logits
            assert (got - expected_logits).abs().max() > 1e-3, name


def _check_grads(model, expected: dict, name: str) -> None:
    """Every gradient of the first step, gathered over tp and dp, equals the reference's (``None`` for a frozen
    parameter): the replicated vision side's gradients are whole, not a tp part or a tp sum (Adam's steps alone
    would hide a constant factor)."""
    for pname, param in model.named_parameters():
        grad = param.grad
        if expected[pname] is None:
            assert grad is None, (name, pname)
            continue
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        # fp32 noise scales with the tensor: Gemma 3's projector (after an RMSNorm of nearly constant pooled features)
        # has gradients up to 1.2e7 here, where fp32 itself is 12 off fp64 in one process
        scale = max(1.0, float(expected[pname].abs().max()))
        torch.testing.assert_close(full, expected[pname], atol=1e-5 * scale, rtol=1e-4,
                                   msg=lambda m, n=pname: f"{name} {n} grad: {m}")


def _train(model, ref, name, context, frozen):
    """ZeRO-3 over dp, 3 AdamW steps on rows ``d::dp``: step-0 logits and gradients, each step's dp-mean loss, and
    (frozen) optimizer state for exactly the trainable parameters. Returns the wrapped model."""
    dp, d = context.dp_size, context.dp_rank
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    model, opt = training.shard_data_parallel(model, opt, zero_stage=3)
    inner = training.unwrap_model(model)
    local = with_global_share(inner, rows(ref["batch"], slice(d, None, dp)), True)
    for step in range(STEPS):
        breadcrumb(f"{name} frozen={frozen}: step {step}")
        out = model(**local)
        if step == 0:
            torch.testing.assert_close(out.logits, ref["logits"][d::dp], **TOL)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss, group=context.dp_group)
        torch.testing.assert_close(loss / dp, ref["losses"][step], msg=lambda m: f"{name} step {step}: {m}", **TOL)
        out.loss.backward()
        if step == 0:
            _check_grads(inner, ref["grads"], name)
        opt.step(), opt.zero_grad()
    if frozen:  # no optimizer state for the vision side: exactly the trainable parameters have state
        trainable = sum(p.requires_grad for p in inner.parameters())
        assert len(opt.state) == trainable < len(list(inner.parameters())), (name, len(opt.state), trainable)
    return model


def _worker(paths, refs, work):
    context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    for name in TYPES:
        frozen = name not in TRAINED
        ref = refs[name][frozen]
        batch = ref["batch"]
        breadcrumb(f"{name}: load")
        model = om.AutoModelForImageTextToText.from_pretrained(paths[name], parallel=context, freeze_vision=frozen)
        assert type(model).__module__.startswith("transformers.") and any(
            hasattr(p, "placements") for p in model.parameters())
        plain = {k: v for k, v in batch.items() if k != "labels"}
        breadcrumb(f"{name}: generate")
        tokens = model.generate(**plain, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(tokens, ref["generated"]), (name, tokens, ref["generated"])
        with torch.no_grad():
            torch.testing.assert_close(model(**plain).logits, ref["logits"], **TOL)
        _control(model, name, batch, ref["logits"])
        model = _train(model, ref, name, context, frozen)
        out_dir = os.path.join(work, "out", name)
        training.save_pretrained(model, out_dir)
        if context.rank == 0:
            saved = transformers.AutoModelForImageTextToText.from_pretrained(out_dir).eval()
            state = saved.state_dict()
            for key, value in ref["state"].items():
                torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{name} {k}: {m}", atol=1e-5,
                                           rtol=1e-4)
            with torch.no_grad():
                torch.testing.assert_close(saved(**plain).logits, ref["logits_after"], **TOL)
        context.barrier()
        del model
        # the other mode (vision frozen where it trained above, and the reverse): training parity only
        breadcrumb(f"{name}: other mode")
        model = om.AutoModelForImageTextToText.from_pretrained(paths[name], parallel=context,
                                                               freeze_vision=not frozen)
        _train(model, refs[name][not frozen], name, context, not frozen)
        del model


@pytest.mark.slow
def test_image_text_types_train_like_transformers(tmp_path):
    paths = save(tmp_path / "models")
    refs = {name: {frozen: reference_run(paths[name], name, freeze=frozen, generate=frozen == (name not in TRAINED))
                   for frozen in (False, True)} for name in TYPES}
    run_distributed(_worker, 4, paths, refs, str(tmp_path))
