"""LoRA (``peft``) on a generic-path model at tensor parallelism: adapters loaded from a folder train exactly.

One spawned group of 4 gloo processes at tp 2 x dp 2, ZeRO 0 and ZeRO 3. An adapter made by plain ``peft`` on plain
``transformers`` Granite (random ``A`` and ``B``, ``init_lora_weights=False``; q/k/v/o and gate/up/down: colwise and
rowwise bases) is loaded with ``adapters.load_adapter``: the adapters take their base's placements
(``generic/lora_tensor_parallel.py``) and equal plain ``peft``'s loaded ones. 3 AdamW steps through
``training.shard_data_parallel`` on rows with unequal label counts: losses and every adapter (``full_tensor``) equal
plain ``peft`` on the global batch (fp32, 1e-5); ``adapters.save_adapter`` writes the full adapter plain ``peft``
opens with the reference's tensors. Negative controls: with one rowwise ``lora_A``'s all-reduce left out (its local
product only) the first loss differs from ``peft``'s; the adapters moved from their loaded values.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
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

ROWS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _assert_adapters(local: dict, reference, atol=1e-5):
    assert_adapters(local, reference, atol, count=2 * 2 * len(TARGETS))


def _reference(base, adapter):
    return peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter,
                                          is_trainable=True).train()


def _worker(base, adapter, root):
    rows = sft_rows(101, 48)
    for zero_stage in (0, 3):
        breadcrumb(f"granite LoRA tp2 x dp2 zero{zero_stage}")
        parallel = om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, zero_stage=zero_stage)
        model = adapters.load_adapter(om.AutoModelForCausalLM.from_pretrained(base, parallel=parallel).train(),
                                      adapter, is_trainable=True)
        inner = model.get_base_model()
        context = inner.parallel_context
        reference = _reference(base, adapter)
        loaded = lora_adapters(model)
        _assert_adapters(loaded, reference)  # the loaded pieces are peft's full tensors
        per = ROWS // 2
        local = [with_global_share(inner, _collate(rows[s * ROWS + context.dp_rank * per:
                                                         s * ROWS + (context.dp_rank + 1) * per]), True)
                 for s in range(3)]
        if zero_stage == 0:  # negative control: a rowwise lora_A without its all-reduce (local partial sums)
            lora_a = inner.model.layers[0].self_attn.o_proj.lora_A["default"]
            installed = lora_a.forward  # the RowwiseParallel forward (an instance attribute)
            lora_a.forward = lambda x, m=lora_a: F.linear(x, m.weight.to_local())
            with torch.no_grad():
                broken = model(**local[0]).loss.detach().clone()
            lora_a.forward = installed
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
        wrapped, optimizer = training.shard_data_parallel(model, optimizer, zero_stage=zero_stage)
        ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **ADAMW)
        for step in range(3):
            loss = wrapped(**local[step]).loss
            loss.backward()
            optimizer.step(), optimizer.zero_grad()
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=context.dp_group)
            expected = reference(**_collate(rows[step * ROWS:(step + 1) * ROWS])).loss
            expected.backward()
            ref_optimizer.step(), ref_optimizer.zero_grad()
            torch.testing.assert_close(loss / context.dp_size, expected.detach(), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"zero{zero_stage} step {step} loss: {m}")
            if step == 0 and zero_stage == 0:
                dist.all_reduce(broken, group=context.dp_group)
                assert (broken - loss).abs() / context.dp_size > 1e-4, (broken, loss)
        trained = lora_adapters(model)
        _assert_adapters(trained, reference)
        for key, value in loaded.items():  # negative control: the adapters were trained
            assert (trained[key] - value).abs().max() > 1e-4, key
        folder = os.path.join(root, f"zero{zero_stage}")
        adapters.save_adapter(model, folder)
        if dist.get_rank() == 0:
            saved = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), folder)
            _assert_adapters({n: p.detach() for n, p in saved.named_parameters() if "lora_" in n}, reference)
        dist.barrier()
        del model, wrapped, optimizer


@pytest.mark.slow
def test_generic_lora_tensor_parallel(tmp_path):
    base = save(tmp_path / "models", ["granite"])["granite"]
    torch.manual_seed(1)
    reference = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                    init_lora_weights=False))
    adapter = str(tmp_path / "adapter")
    reference.save_pretrained(adapter)
    run_distributed(_worker, 4, base, adapter, str(tmp_path / "saved"), timeout=900)
