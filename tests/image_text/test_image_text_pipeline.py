"""Image-text models at pp 2 x dp 2 train exactly like single-process ``transformers`` (``image_text/pipeline.py``).

One spawned group of 4 gloo processes. LLaVA (CLIP tower + projector, Llama decoder), Qwen2.5-VL (windowed vision
transformer, M-RoPE positions computed on every stage from ``image_grid_thw``) and Gemma 3 (4 layers; SigLIP tower,
tied embedding on the first and last stage, the bidirectional image-block mask from ``token_type_ids`` on every stage),
each loaded with ``om.AutoModelForImageTextToText`` from a saved Hub folder, 1F1B with 2 microbatches of one row per
replica, on the 4-row image-text batch of ``batches.py`` (prompt and image tokens masked, rows with different label
counts, right padding), data-parallel rank ``d`` taking rows ``d::2`` and their images; each type with the vision
tower trained and frozen (``freeze_vision=True``) at two ZeRO stages between them. Also, once each: SmolVLM (frozen,
ZeRO-0: images stacked by row already) and Mistral 3 (trained, ZeRO-2: ``image_sizes`` regrouped by row; the test rows
hold each image's tokens in one run, which Pixtral's processor does not: its rows are not tested here):

- each of 3 AdamW steps' loss (``train_step``: the dp mean over the global batch's label count) and every parameter
  this rank holds after them equal the single-process run on the whole batch (fp32, 1e-5); frozen, the vision
  parameters (on the first stage only) are unchanged and have no gradient;
- each rank holds only its stage's parameters: the vision tower and projector on the first stage only;
- negative controls (each must give other losses than the reference's): LLaVA with each replica's two images
  swapped between its rows (so between its microbatches); Qwen2.5-VL with ``image_grid_thw`` / ``mm_token_type_ids``
  given to the first stage only (the second stage computes text-only positions); Gemma 3 with ``token_type_ids`` given
  to the first stage only (the second stage's image tokens attend causally);
- refused at load with the reason: Qwen3-VL (its deepstack features are added between decoder layers), LLaVA-NeXT
  (its base model holds ``image_newline`` as a bare parameter, which no stage module can carry).

Qwen2.5-VL trains through ``pixel_values`` regrouped by row (its patches are flattened over images); Gemma 3 through
its tied embedding summed over the two stages.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from oslo_models.generic.install_state import generic_install
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share
from tests.image_text.batches import rows
from tests.image_text.models import config, save
from tests.image_text.parity import ADAMW, STEPS, TOL, reference_run

# (type, vision frozen, ZeRO stage)
CASES = (("llava", False, 3), ("llava", True, 1), ("qwen2_5_vl", False, 0), ("qwen2_5_vl", True, 3),
         ("gemma3", True, 2), ("gemma3", False, 0), ("smolvlm", True, 0), ("mistral3", False, 2))


def _train(path, name, frozen, zero, batch, swap_images=False, first_stage_only=False, tp=1):
    parallel = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=4 // (2 * tp), tensor_parallel_size=tp,
                                 num_microbatches=2, zero_stage=zero)
    model = om.AutoModelForImageTextToText.from_pretrained(path, parallel=parallel, freeze_vision=frozen).train()
    context = model.parallel_context
    pieces = generic_install(model).pipeline_adapter.pieces
    names = [n for n, _ in model.named_parameters()]
    vision = [n for n in names if n.startswith(tuple(p + "." for p in pieces.first))]
    assert pieces.first and bool(vision) == model.pipeline_layout.has_first, (name, pieces.first, vision)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    model, opt = training.shard_data_parallel(model, opt, zero_stage=zero)
    inner = training.unwrap_model(model)
    local = rows(batch, slice(context.dp_rank, None, context.dp_size))
    if swap_images:  # negative control: each row of the replica gets the other row's image
        local["pixel_values"] = rows(batch, [context.dp_rank + 2, context.dp_rank])["pixel_values"]
    if first_stage_only:  # negative control: the grids / token types given to the first stage only
        generic_install(inner).pipeline_adapter.every_stage = ()
    local = with_global_share(inner, local, True)
    losses = []
    for step in range(STEPS):
        breadcrumb(f"{name} frozen={frozen} zero{zero}: step {step}")
        losses.append(inner.train_step(local, optimizer=opt))
        if step == 0 and frozen:
            assert all(p.grad is None for n, p in inner.named_parameters() if n in vision)
    return inner, torch.stack(losses)


def _worker(paths, refs):
    for name, frozen, zero in CASES:
        ref = refs[name, frozen]
        model, losses = _train(paths[name], name, frozen, zero, ref["batch"])
        torch.testing.assert_close(losses, torch.stack(ref["losses"]), msg=lambda m: f"{name} {frozen}: {m}", **TOL)
        for pname, param in model.named_parameters():
            value = param.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(value, ref["state"][pname], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=pname: f"{name} frozen={frozen} {n}: {m}")
        del model
    for name, control in (("llava", "swap_images"), ("qwen2_5_vl", "first_stage_only"),
                          ("gemma3", "first_stage_only")):
        breadcrumb(f"negative control {name} {control}")
        ref = refs[name, False]
        _, losses = _train(paths[name], name, False, 0, ref["batch"], **{control: True})
        assert (losses - torch.stack(ref["losses"])).abs().max() > 1e-4, (name, control, losses, ref["losses"])
    breadcrumb("qwen3_vl refused")  # its deepstack features are added to the hidden states between layers
    with pytest.raises(NotImplementedError, match="changes 'hidden_states' between its layers"):
        om.AutoModelForImageTextToText.from_pretrained(paths["qwen3_vl"], parallel=om.ParallelConfig(
            pipeline_parallel_size=2, data_parallel_size=2))
    with pytest.raises(NotImplementedError, match="image_newline"):
        om.AutoModelForImageTextToText.from_pretrained(paths["llava_next"], parallel=om.ParallelConfig(
            pipeline_parallel_size=2, data_parallel_size=2))


def _deep_gemma3(path) -> str:
    """Gemma 3 with 4 layers (sliding, full, sliding, full): the second stage's layers see the image tokens' hidden
    states of the first's, so its image-block mask changes the caption's loss (with 2 layers it could not: only the
    image tokens' own, unlabelled, outputs would change)."""
    cfg = config("gemma3")
    text = cfg.get_text_config()
    text.num_hidden_layers, text.layer_types = 4, list(text.layer_types) * 2
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(str(path))
    return str(path)


@pytest.mark.slow
def test_image_text_pipeline_trains_like_transformers(tmp_path):
    paths = save(tmp_path / "models", ("llava", "qwen2_5_vl", "llava_next", "smolvlm", "mistral3", "qwen3_vl"))
    paths["gemma3"] = _deep_gemma3(tmp_path / "models" / "gemma3")
    refs = {(name, frozen): reference_run(paths[name], name, freeze=frozen, generate=False)
            for name, frozen, _ in CASES}
    run_distributed(_worker, 4, paths, refs)


# (type, vision frozen, ZeRO stage) at pp 2 x tp 2 (dp 1)
TENSOR_PARALLEL = (("llava", False, 0), ("qwen2_5_vl", True, 0), ("gemma3", False, 0))


def _tensor_parallel_worker(paths, refs):
    _worker_tp(paths, refs)
    breadcrumb("negative control qwen2_5_vl first_stage_only at tp 2")
    ref = refs["qwen2_5_vl", False]
    _, losses = _train(paths["qwen2_5_vl"], "qwen2_5_vl", False, 0, ref["batch"], first_stage_only=True, tp=2)
    assert (losses - torch.stack(ref["losses"])).abs().max() > 1e-4, losses


def _worker_tp(paths, refs):
    for name, frozen, zero in TENSOR_PARALLEL:
        ref = refs[name, frozen]
        model, losses = _train(paths[name], name, frozen, zero, ref["batch"], tp=2)
        torch.testing.assert_close(losses, torch.stack(ref["losses"]), msg=lambda m: f"{name} tp2: {m}", **TOL)
        for pname, param in model.named_parameters():
            value = param.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(value, ref["state"][pname], atol=1e-5, rtol=1e-4,
                                       msg=lambda m, n=pname: f"{name} tp2 frozen={frozen} {n}: {m}")
        del model


@pytest.mark.slow
def test_image_text_pipeline_tensor_parallel(tmp_path):
    """pp 2 x tp 2 (4 processes, dp 1: 2 microbatches of 2 rows): LLaVA (trained), Qwen2.5-VL (frozen) and the
    4-layer Gemma 3 (trained; its tied embedding split by vocabulary on both stages) - the language model split by
    ``transformers``' plan on each stage, the vision tower replicated over tp on the first - equal ``transformers``
    (losses and every parameter after 3 AdamW steps, 1e-5); negative control: Qwen's grids given to the first stage
    only."""
    paths = save(tmp_path / "models", ("llava", "qwen2_5_vl"))
    paths["gemma3"] = _deep_gemma3(tmp_path / "models" / "gemma3")
    refs = {(name, frozen): reference_run(paths[name], name, freeze=frozen, generate=False)
            for name, frozen in {(n, f) for n, f, _ in TENSOR_PARALLEL} | {("qwen2_5_vl", False)}}
    run_distributed(_tensor_parallel_worker, 4, paths, refs)
