"""``om.training.Trainer`` (``transformers.Trainer`` + ``ParallelTrainerMixin``) on a LoRA Llama at tp 2 x dp 2 and
tp 4 + SP (4 gloo processes): per-step logged losses and gradient norms equal a single-process plain ``Trainer`` on
plain ``peft`` + ``transformers`` with the same data (fp32, 1e-5); the checkpoint holds a plain ``peft`` adapter
equal to the reference's; resuming from it continues with the uninterrupted run's losses.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")

import oslo_models as om  # noqa: E402
from tests.adapters.test_lora import _ours, _reference, _save_case  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.zoo import tiny_config  # noqa: E402

STEPS, ROWS, SEQ = 4, 16, 8


def _dataset() -> list[dict]:
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(0, tiny_config("llama").vocab_size, (ROWS, SEQ), generator=generator)
    return [dict(input_ids=row, attention_mask=torch.ones_like(row), labels=row.clone()) for row in ids]


def _args(output_dir: str, batch: int) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=5e-2,
        logging_steps=1, save_steps=2, report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", optim="adamw_torch", max_grad_norm=0.5)


def _logged(trainer) -> list[tuple[int, float, float]]:
    return [(entry["step"], entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history
            if "loss" in entry]


def _check_logs(got, expected) -> None:
    assert [step for step, *_ in got] == [step for step, *_ in expected], (got, expected)
    torch.testing.assert_close(torch.tensor([v[1:] for v in got], dtype=torch.float64),
                               torch.tensor([v[1:] for v in expected], dtype=torch.float64), atol=1e-5, rtol=1e-5)


def _trainer_worker(base: str, adapter: str, root: str, expected: list, reference_adapter: str) -> None:
    from safetensors.torch import load_file

    for name, layout in (("tp2_dp2", dict(tensor_parallel_size=2, data_parallel_size=2)),
                         ("tp4_sp", dict(tensor_parallel_size=4, sequence_parallel=True))):
        dp = layout.get("data_parallel_size", 1)
        out = os.path.join(root, name)
        trainer = om.training.Trainer(model=_ours("llama", base, adapter, **layout),
                                      args=_args(out, 4 // dp), train_dataset=_dataset())
        trainer.train()
        _check_logs(_logged(trainer), expected)
        if name != "tp2_dp2":
            continue
        final = os.path.join(out, f"checkpoint-{STEPS}")
        if trainer.parallel_context.rank == 0:  # a plain peft folder, equal to the reference's (gathered)
            got, want = (load_file(os.path.join(folder, "adapter_model.safetensors"))
                         for folder in (final, reference_adapter))
            assert sorted(got) == sorted(want)
            for key in want:
                torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-4)
        resumed = om.training.Trainer(model=_ours("llama", base, adapter, **layout), args=_args(out, 4 // dp),
                                      train_dataset=_dataset())
        resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
        _check_logs(_logged(resumed)[-2:], expected[2:])


def test_trainer_tp_dp_matches_single_process_and_resumes(tmp_path):
    base, adapter = _save_case("llama", tmp_path)
    reference = transformers.Trainer(model=_reference("llama", base, adapter),
                                     args=_args(str(tmp_path / "reference"), 4), train_dataset=_dataset())
    reference.train()
    expected = _logged(reference)
    assert len(expected) == STEPS
    run_distributed(_trainer_worker, 4, base, adapter, str(tmp_path), expected,
                    str(tmp_path / "reference" / f"checkpoint-{STEPS}"))
