"""LoRA (``peft``) on a pipelined generic causal LM: each stage's adapters train like single-process ``peft``.

One spawned group of 4 gloo processes at pp 2 x dp 2 (1F1B, two microbatches per replica). An adapter made by plain
``peft`` on plain ``transformers`` (random ``A`` and ``B``, ``init_lora_weights=False``; q/v projections and the
MLP's down projection) is loaded onto the pipelined model with ``adapters.load_adapter``: each rank builds the
adapters of its own stage's layers only (the other layers are parameter-free probes). 3 AdamW steps on the adapters
through ``training.prepare`` and ``model.train_step`` on rows with unequal label counts: the logged losses and every
adapter equal plain ``peft`` trained on each step's global batch (fp32, 1e-5), for Granite (untied) and Cohere 2
(tied embeddings frozen on both stages), both at ZeRO-0, and Granite at ZeRO-3, Cohere 2 at ZeRO-2 (each stage an
FSDP2 root over dp inside the peft wrapper: frozen base weights and trainable adapters in the same units); every
stage's adapters moved away from their loaded
values (negative control: the comparison against the untrained adapter fails); ``adapters.save_adapter`` (every
rank) writes the adapters of every stage, which plain ``peft`` opens with the reference's tensors.
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
from tests.generic.models import save  # noqa: E402
from tests.helpers.dist import breadcrumb, run_distributed  # noqa: E402
from tests.helpers.global_loss import with_global_share  # noqa: E402
from tests.helpers.lora import assert_adapters, lora_adapters  # noqa: E402
from tests.helpers.pipeline import ADAMW  # noqa: E402
from tests.training.test_global_batch_loss import _collate, sft_rows  # noqa: E402

ROWS = 8  # global batch of a step
TARGETS = ["q_proj", "v_proj", "down_proj"]
CASES = [("granite", 0), ("cohere2", 0), ("granite", 3), ("cohere2", 2)]  # (name, ZeRO stage)


def _worker(paths, root):
    from accelerate import Accelerator

    rows = sft_rows(101, 48)
    for name, zero_stage in CASES:
        breadcrumb(f"{name} LoRA pp2 x dp2 zero{zero_stage}")
        base, adapter = paths[name]
        parallel = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2,
                                     zero_stage=zero_stage)
        model = adapters.load_adapter(om.AutoModelForCausalLM.from_pretrained(base, parallel=parallel).train(),
                                      adapter, is_trainable=True)
        inner = model.get_base_model()
        layers = {f"layers.{index}." for index in inner.pipeline_layout.local_layers()}
        loaded = lora_adapters(model)
        assert loaded and all(any(layer in key for layer in layers) for key in loaded), sorted(loaded)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
        wrapped, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=zero_stage)
        if zero_stage >= 2:  # the runner's stages are FSDP2 roots, the adapters sharded over dp
            assert training.training_state(inner).stage_modules, "no FSDP2 stage roots on the pipelined model"
            assert all(hasattr(p, "placements") for n, p in model.named_parameters() if "lora_" in n)
        reference = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter,
                                                   is_trainable=True).train()
        ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **ADAMW)
        context, per = inner.parallel_context, ROWS // 2
        for step in range(3):
            start = step * ROWS + context.dp_rank * per
            loss = wrapped.train_step(with_global_share(inner, _collate(rows[start:start + per]), True))
            optimizer.step(), optimizer.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            expected = reference(**_collate(rows[step * ROWS:(step + 1) * ROWS])).loss
            expected.backward()
            ref_optimizer.step(), ref_optimizer.zero_grad()
            torch.testing.assert_close(loss / dist.get_world_size(), expected.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} step {step} loss: {m}")
        trained = lora_adapters(model)
        assert_adapters(trained, reference)
        for key, value in loaded.items():  # negative control: this stage's adapters were trained
            assert (trained[key] - value).abs().max() > 1e-4, key
        folder = os.path.join(root, f"{name}_zero{zero_stage}")
        adapters.save_adapter(model, folder)
        if dist.get_rank() == 0:
            saved = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), folder)
            assert_adapters({n: p.detach() for n, p in saved.named_parameters() if "lora_" in n}, reference)
            assert len([n for n, _ in saved.named_parameters() if "lora_" in n]) == 2 * len(loaded)
        dist.barrier()


@pytest.mark.slow
def test_generic_pipeline_lora(tmp_path):
    names = sorted({name for name, _ in CASES})
    bases = save(tmp_path / "models", names)
    paths = {}
    for name in names:
        torch.manual_seed(1)
        reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(bases[name]),
                                        peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                        init_lora_weights=False))
        paths[name] = (bases[name], str(tmp_path / f"{name}_adapter"))
        reference.save_pretrained(paths[name][1])
    run_distributed(_worker, 4, paths, str(tmp_path / "saved"), timeout=900)
