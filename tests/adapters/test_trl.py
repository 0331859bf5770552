"""TRL's ``SFTTrainer`` on a parallel model, against ``SFTTrainer`` on plain ``peft`` + ``transformers``.

TRL (>= 1.x) ``SFTTrainer`` replaces the model's forward with a fused LM head that multiplies by the LM head's weight,
which under tensor parallelism is this rank's vocabulary shard (a wrong, low loss: 3.95 instead of 4.63 on the tiny
Llama at tp 2, seen). ``ParallelTrainerMixin`` puts ``training/trl_head.py`` in its place; checked here against TRL's
own head at tp 2 x dp 2: the loss, every per-token field and every adapter gradient (fp32, 1e-5).

Whole trainers: ``class SFT(ParallelTrainerMixin, trl.SFTTrainer)`` on our LoRA Llama logs the losses, gradient
norms and metrics of plain ``SFTTrainer`` at every step (padded rows of several lengths, TRL's collator and defaults:
gradient checkpointing on, ``average_tokens_across_devices``), at tp 1 and at tp 2 x dp 2 (rows split by dp rank
only). One default is set: ``bf16=False``. ``SFTConfig`` defaults to ``bf16=True``, so both trainers ran under CPU
bf16 autocast, which is what made them differ from each other and from a direct fp32 computation (issue 32: grad
norm 0.62371 vs 0.62328). Under bf16 each trainer equals a direct autocast computation of its own model bit for bit,
and the two models' forwards, activation gradients and LoRA gradients are bitwise equal through a plain logits loss;
what differs is the LM head's backward: TRL's chunked head accumulates the hidden states' gradient in fp32, ours
(``trl_head.py``) differentiates the model's bf16 autocast logits as plain ``transformers`` does (adapter gradients a
few bf16 ulps apart, step-1 grad norm 0.67364 vs 0.67433 here, fp32 0.673886): the negative control below. In fp32
they agree to ~1e-6. TRL is in the dev extras; skipped without it.
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")

import oslo_models as om  # noqa: E402
from oslo_models.training.trainer import ParallelTrainerMixin  # noqa: E402
from tests.adapters.test_lora import _ours, _reference, _save_case  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.zoo import tiny_config  # noqa: E402

SEQ, ROWS, STEPS = 8, 16, 4
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


class SFT(ParallelTrainerMixin, trl.SFTTrainer):
    """TRL's ``SFTTrainer`` on an ``oslo_models`` model: the mixin first."""


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary (``t0`` pads): TRL takes its pad id from it."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(tiny_config("llama").vocab_size)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                                pad_token="t0", eos_token="t2", unk_token="t1")


def _dataset():
    """Pre-tokenized rows of 8, 7 and 6 tokens: TRL's collator pads them (labels -100 there)."""
    from datasets import Dataset

    ids = torch.randint(3, tiny_config("llama").vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    return Dataset.from_dict({"input_ids": [row[:SEQ - i % 3].tolist() for i, row in enumerate(ids)]})


def _sft(trainer_class, model, output_dir: str, batch: int, **options):
    settings = dict(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=5e-2,
                    logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                    train_sampling_strategy="sequential", optim="adamw_torch", max_grad_norm=0.5, bf16=False)
    args = trl.SFTConfig(**{**settings, **options})
    trainer = trainer_class(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer())
    trainer.train()
    return [[entry[key] for key in LOGGED] for entry in trainer.state.log_history if "loss" in entry]


def _check_logs(got, expected) -> None:
    """Every logged value at every step. Measured at tp 1: losses within 5e-7, grad norms within 4e-6 (AdamW at lr
    5e-2 carries fp32 rounding into later steps); the bound is 1e-5."""
    assert len(got) == len(expected), (got, expected)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\n{LOGGED}\n{got}\n{expected}")


def _head_grads(model, batch: dict, fused: bool):
    out = model(**batch, labels=batch["input_ids"], fused_lm_head=fused, use_cache=False)
    out.loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _worker(base: str, adapter: str, expected: dict, root: str) -> None:
    """tp 2 x dp 2: the replaced head gives TRL's fields and gradients (every rank the same batch); then a whole
    SFT run (2 rows per replica) logs the single-process plain SFTTrainer's values (2 steps: 4-rank steps cost
    ~4 s each on a loaded 2-core CI; tp 1 checks all 4)."""
    from trl.trainer.utils import add_fused_lm_head

    from oslo_models.training.trl_head import replace_trl_head
    from tests.adapters.test_lora import assert_adapters_match

    model = _ours("llama", base, adapter, tensor_parallel_size=2, data_parallel_size=2)
    om.distributed.mark_gradients_reduced(model, "test: the same batch on every replica, gradients compared")
    add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    assert replace_trl_head(model.get_base_model())
    out, _ = _head_grads(model, expected["batch"], True)
    for key in ("loss", "log_probs", "entropy", "is_top1", "label_mask"):
        torch.testing.assert_close(getattr(out, key), expected[key], atol=1e-5, rtol=1e-4, msg=key)
    reference = _reference("llama", base, adapter)  # its gradients (a pickled module would arrive without them)
    add_fused_lm_head(reference.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    _head_grads(reference, expected["batch"], True)
    assert assert_adapters_match(model, reference, grads=True) > 0
    model = _ours("llama", base, adapter, tensor_parallel_size=2, data_parallel_size=2)
    _check_logs(_sft(SFT, model, os.path.join(root, "tp2_dp2"), 2, max_steps=2), expected["sft"][:2])


def test_sft_trainer_matches_plain_sft_and_trl_head(tmp_path):
    """Plain SFTTrainer on plain peft + transformers against SFT(ParallelTrainerMixin, SFTTrainer) on ours at tp 1
    and tp 2 x dp 2 (logs at every step), TRL's bf16 default as the negative control, and TRL's fused LM head against
    ours (``training/trl_head.py``) at tp 2 x dp 2."""
    from trl.trainer.utils import add_fused_lm_head

    base, adapter = _save_case("llama", tmp_path)
    expected = _sft(trl.SFTTrainer, _reference("llama", base, adapter), str(tmp_path / "reference"), 4)
    _check_logs(_sft(SFT, _ours("llama", base, adapter), str(tmp_path / "tp1"), 4), expected)
    # TRL's default bf16=True (CPU autocast): the same run misses the fp32 reference's gradient norm from step 1
    bf16 = _sft(SFT, _ours("llama", base, adapter), str(tmp_path / "bf16"), 4, bf16=True, max_steps=1)
    assert abs(bf16[0][1] - expected[0][1]) > 1e-4, (bf16, expected)
    reference = _reference("llama", base, adapter)
    add_fused_lm_head(reference.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    ids = torch.randint(3, tiny_config("llama").vocab_size, (4, SEQ), generator=torch.Generator().manual_seed(5))
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    out, _ = _head_grads(reference, batch, True)
    head = {key: getattr(out, key).detach() for key in ("loss", "log_probs", "entropy", "is_top1", "label_mask")}
    run_distributed(_worker, 4, base, adapter, dict(head, batch=batch, sft=expected), str(tmp_path), timeout=600)
