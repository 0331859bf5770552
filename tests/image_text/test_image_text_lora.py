"""LoRA (``peft``) on the language model of image-text models at dp 4 trains like single-process ``peft``.

An adapter made by plain ``peft`` on plain ``transformers`` (random ``A`` and ``B``, ``init_lora_weights=False``) on
the decoder's q/v/down projections only (a regex on ``language_model``: the vision tower has q/v projections of its
own, which stay without adapters) is loaded with ``adapters.load_adapter`` onto LLaVA (ZeRO-0) and Qwen2.5-VL (ZeRO-3,
M-RoPE) at dp 4 (one row and its image per rank). 3 AdamW steps on the adapters on the image-text batch
(``batches.py``): every step's dp-mean loss and, after the steps, every adapter equal plain ``peft`` on the whole
batch (fp32, 1e-5); the adapters moved (negative control: the loaded ones fail the comparison); only
language-model modules got adapters; ``adapters.save_adapter`` writes a folder plain ``peft`` opens with the
reference's adapters.

Not at tp 2: on the generic path ``peft`` wraps ``transformers``' tensor-parallel ``nn.Linear`` modules with adapters
of the local shapes (a full adapter does not load: size mismatch), and a rowwise layer's adapter output would not be
summed over tp; LoRA with tensor parallelism needs the native layers (``adapters.register_parallel_layers``).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers

peft = pytest.importorskip("peft")

import oslo_models as om  # noqa: E402
from oslo_models import adapters, training  # noqa: E402
from tests.helpers.dist import breadcrumb, run_distributed  # noqa: E402
from tests.helpers.global_loss import with_global_share  # noqa: E402
from tests.image_text.batches import make_batch, rows  # noqa: E402
from tests.image_text.models import save  # noqa: E402
from tests.image_text.parity import ADAMW, STEPS  # noqa: E402

CASES = {"llava": 0, "qwen2_5_vl": 3}  # type: ZeRO stage
TARGETS = r".*language_model.*\.(q_proj|v_proj|down_proj)"


def _full(tensor):
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _adapters(model) -> dict:
    return {name: _full(param).clone() for name, param in model.named_parameters() if "lora_" in name}


def _assert_adapters(local: dict, reference):
    full = dict(reference.named_parameters())
    assert local
    for name, value in local.items():
        torch.testing.assert_close(value, full[name].detach(), atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _reference(base, adapter):
    model = transformers.AutoModelForImageTextToText.from_pretrained(base)
    return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True).train()


def _worker(paths, root):
    context = om.ParallelContext.from_config(om.ParallelConfig())
    dp, d = context.dp_size, context.dp_rank
    for name, zero_stage in CASES.items():
        breadcrumb(f"{name} LoRA dp4 zero{zero_stage}")
        base, adapter = paths[name]
        model = adapters.load_adapter(
            om.AutoModelForImageTextToText.from_pretrained(base, parallel=context).train(), adapter,
            is_trainable=True)
        loaded = _adapters(model)
        assert loaded and all("language_model" in key for key in loaded), sorted(loaded)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
        wrapped, opt = training.shard_data_parallel(model, opt, zero_stage=zero_stage)
        reference = _reference(base, adapter)
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **ADAMW)
        batch = make_batch(name, reference.get_base_model())
        local = with_global_share(model.get_base_model(), rows(batch, slice(d, None, dp)), True)
        for step in range(STEPS):
            loss = wrapped(**local).loss
            loss.backward()
            opt.step(), opt.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=context.dp_group)
            expected = reference(**batch).loss
            expected.backward()
            ref_opt.step(), ref_opt.zero_grad()
            torch.testing.assert_close(loss / dp, expected.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} step {step}: {m}")
        trained = _adapters(model)
        _assert_adapters(trained, reference)
        for key, value in loaded.items():  # negative control: the adapters moved
            assert (trained[key] - value).abs().max() > 1e-4, key
        folder = os.path.join(root, name)
        adapters.save_adapter(model, folder)
        if context.rank == 0:
            saved = peft.PeftModel.from_pretrained(transformers.AutoModelForImageTextToText.from_pretrained(base),
                                                   folder)
            _assert_adapters({n: p.detach() for n, p in saved.named_parameters() if "lora_" in n}, reference)
        context.barrier()
        del model, wrapped, opt


@pytest.mark.slow
def test_image_text_lora(tmp_path):
    bases = save(tmp_path / "models", tuple(CASES))
    paths = {}
    for name in CASES:
        torch.manual_seed(1)
        reference = peft.get_peft_model(transformers.AutoModelForImageTextToText.from_pretrained(bases[name]),
                                        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                        init_lora_weights=False))
        paths[name] = (bases[name], str(tmp_path / f"{name}_adapter"))
        reference.save_pretrained(paths[name][1])
    run_distributed(_worker, 4, paths, str(tmp_path / "saved"))
