"""TRL's ``DPOTrainer`` and ``GRPOTrainer`` on a parallel model at tp 2 x dp 2, against the same trainers on plain
``transformers``: every logged value (loss, gradient norm, rewards, log-probabilities, logits, entropy, KL) at every
step, fp32 (``bf16=False``), 1e-5; both also at tp 2 x dp 2 with ZeRO-3 (the policy sharded over dp).

``class ParDPO(ParallelTrainerMixin, trl.DPOTrainer)`` with ``ref_model=None`` (TRL reloads the reference from the
policy's ``name_or_path``; the mixin loads it at the policy's layout), against ``DPOTrainer`` in one process on the
global batch. ``class ParGRPO(ParallelTrainerMixin, trl.GRPOTrainer)`` with ``beta=0.04`` (a reference), on
completions the model samples itself at tp 2 (temperature 0.7, top-p 0.95) from left-padded prompts of unequal
lengths, against ``GRPOTrainer`` at dp 2 (two processes): replica ``d`` draws from the random stream of TRL's
process ``d`` (the mixin seeds ``seed + dp_rank``), its tp ranks alike (the same shuffle of each generation batch,
the same samples), and holds the same rows (the generation batch is sized over dp; whole groups per replica). The
reward (the row's place in its group plus the prompt's length) is built in.

Negative control: TRL's own fused head on the tp-split model (it multiplies by this rank's vocabulary shard) gives
other log-probabilities than plain ``transformers``; the replaced head gives them. Breakages seen while building
it: tp ranks seeded ``seed + process_index`` (TRL's), or left with their own RNG state after ``generate``, shuffle
the rollout differently and compute on different rows (KL 27 and 2364 instead of 0 at step 1).
"""
from __future__ import annotations

import os

import pytest
import torch
import transformers

trl = pytest.importorskip("trl")

import oslo_models as om  # noqa: E402
from oslo_models.training.trainer import ParallelTrainerMixin  # noqa: E402
from tests.helpers.decoders import save_tiny  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402

VOCAB = 101
STEPS = 2
DPO_LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
              "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy")
GRPO_LOGGED = ("loss", "grad_norm", "reward", "kl", "entropy", "completions/mean_length")


class ParDPO(ParallelTrainerMixin, trl.DPOTrainer):
    """TRL's ``DPOTrainer`` on an ``oslo_models`` model: the mixin first."""


class ParGRPO(ParallelTrainerMixin, trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` on an ``oslo_models`` model: the mixin first."""


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", eos_token="t2",
                                                unk_token="t1")


def _words(g, n):
    return " ".join(f"t{int(i)}" for i in torch.randint(3, VOCAB, (n,), generator=g))


def _preference_data(rows: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(3)
    return Dataset.from_dict({
        "prompt": [_words(g, 2 + i % 3) for i in range(rows)],
        "chosen": [" " + _words(g, 2 + i % 2) + " t2" for i in range(rows)],
        "rejected": [" " + _words(g, 1 + i % 3) + " t2" for i in range(rows)]})


def _prompts(rows: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(4)
    return Dataset.from_dict({"prompt": [_words(g, 2 + i % 3) for i in range(rows)]})


def _reward(prompts, completions, **kwargs):
    """The row's place in its group of 2 plus the prompt's length."""
    return [float(i % 2) + 0.1 * len(p.split()) for i, p in enumerate(prompts)]


def _common(output_dir: str, batch: int) -> dict:
    """``adam_epsilon`` 1e-4: AdamW's first step moves every element with a non-zero gradient by about the learning
    rate, float-noise gradients (~1e-9, where equal completions' policy gradients cancel) included, with a sign
    the summation order decides (seen: 5.6e-5 on the second step's gradient norm at eps 1e-8)."""
    return dict(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=5e-3,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                optim="adamw_torch", max_grad_norm=1.0, bf16=False, adam_epsilon=1e-4)


def _dpo(trainer_class, model, output_dir: str, batch: int) -> list:
    args = trl.DPOConfig(**_common(output_dir, batch), beta=0.1)
    trainer = trainer_class(model=model, ref_model=None, args=args, train_dataset=_preference_data(8),
                            processing_class=_tokenizer())
    trainer.train()
    return [[entry[key] for key in DPO_LOGGED] for entry in trainer.state.log_history if "loss" in entry]


def _grpo(trainer_class, model, output_dir: str, batch: int) -> list:
    args = trl.GRPOConfig(**_common(output_dir, batch), beta=0.04, num_generations=2, max_completion_length=4,
                          temperature=0.7, top_k=0, top_p=0.95, shuffle_dataset=False)
    trainer = trainer_class(model=model, reward_funcs=_reward, args=args, train_dataset=_prompts(8),
                            processing_class=_tokenizer())
    trainer.train()
    return [[entry[key] for key in GRPO_LOGGED] for entry in trainer.state.log_history if "loss" in entry]


def _check(got, expected, names) -> None:
    assert len(got) == len(expected) == STEPS, (got, expected)
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5, msg=lambda m: f"{m}\n{names}\n{got}\n{expected}")


def _ours(path: str, zero_stage: int = 0):
    parallel = om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, zero_stage=zero_stage)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, progress=False).train()


def _worker(path: str, expected: dict, root: str) -> None:
    from trl.trainer.utils import add_fused_lm_head

    from oslo_models.training.trl_head import replace_trl_head

    model = _ours(path)
    assert model.name_or_path == path
    # TRL's head on the tp-split model reads this rank's vocabulary shard; the replacement reads the whole vocabulary
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    trl_head = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.detach()
    assert replace_trl_head(model)
    ours = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.detach()
    torch.testing.assert_close(ours, expected["log_probs"], atol=1e-5, rtol=1e-5)
    assert (trl_head - expected["log_probs"]).abs().max() > 1e-2
    model = _ours(path)
    _check(_dpo(ParDPO, model, os.path.join(root, "dpo"), 2), expected["dpo"], DPO_LOGGED)
    # ZeRO-3 over dp: the policy's parameters sharded over the replicas (after the steps too), the same values logged
    zero3 = _ours(path, zero_stage=3)
    _check(_dpo(ParDPO, zero3, os.path.join(root, "dpo_zero3"), 2), expected["dpo"], DPO_LOGGED)
    from torch.distributed.tensor import DTensor, Shard

    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in zero3.parameters())
    _check(_grpo(ParGRPO, _ours(path), os.path.join(root, "grpo"), 4), expected["grpo"], GRPO_LOGGED)
    # GRPO at ZeRO-3 too: generation and the reference on the dp-sharded policy, the same values logged
    grpo_zero3 = _ours(path, zero_stage=3)
    _check(_grpo(ParGRPO, grpo_zero3, os.path.join(root, "grpo_zero3"), 4), expected["grpo"], GRPO_LOGGED)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in grpo_zero3.parameters())


def _plain_grpo_worker(path: str, root: str) -> None:
    """TRL's GRPOTrainer on plain transformers at dp 2 (two processes); rank 0 writes the logs."""
    import json

    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    logs = _grpo(trl.GRPOTrainer, plain, os.path.join(root, "plain_grpo"), 4)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(root, "plain_grpo.json"), "w", encoding="utf-8") as handle:
            json.dump(logs, handle)


def test_dpo_and_grpo_trainers_match_plain_trl_at_tp2_dp2(tmp_path):
    import json

    path = save_tiny(tmp_path / "llama", "llama", initializer_range=0.2)
    from trl.trainer.utils import add_fused_lm_head

    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    add_fused_lm_head(plain)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    expected = {"log_probs": plain(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.detach()}
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    expected["dpo"] = _dpo(trl.DPOTrainer, plain, str(tmp_path / "dpo"), 4)
    run_distributed(_plain_grpo_worker, 2, path, str(tmp_path), timeout=900)
    with open(tmp_path / "plain_grpo.json", encoding="utf-8") as handle:
        expected["grpo"] = json.load(handle)
    assert min(row[1] for row in expected["grpo"]) > 1e-2  # gradients, not float noise
    run_distributed(_worker, 4, path, expected, str(tmp_path), timeout=900)
