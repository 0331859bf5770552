"""DPO, GRPO and distillation at tp 2 x dp 2 ZeRO-3 against single-process reference code on the whole vocabulary.

One 4-rank world (tiny Llama, vocabulary 101: padded columns at tp 2 and tp 4). Each objective trains 3 AdamW steps
through ``om.post_training.train_step``; every step's global loss and every parameter after the steps equal plain
``transformers`` trained on the global batch with the loss written out in ``tests/helpers/post_training.py``
(fp32, 1e-5):

- DPO (sigmoid, with sequence parallelism) and IPO: the reference model frozen at tp 4 (its own layout, so
  ``run_frozen`` gathers the two replicas' batches over its group); length-normalized DPO against precomputed
  reference log-probabilities. Pairs have unequal completion lengths (padding).
- GRPO on fixed completions and rewards (left-padded prompts, completions cut at EOS), group-normalized advantages,
  KL to a reference at the policy's layout (``beta`` 0.04), sequence-level ``"grpo"`` and token-level ``"dapo"``
  over the global completion-token count.
- Distillation from a wider teacher at tp 4 through its top-8 logits (forward KL), and from a teacher at the
  student's own split with the full reverse KL, mixed with the LM loss over ``-100``-masked labels.

Negative controls (library code on the wrong input, each must miss the reference): the reference model being the
trained policy itself (updated by the steps), advantages that are the raw rewards (not group-normalized), the KL of
distillation over the local vocabulary only.

Pipeline (pp 2 x dp 2, two microbatches per replica, ``train_step`` running the objective as the last stage's loss):
DPO (sigmoid, IPO) and GRPO (``"grpo"`` with a KL to the tp-4 reference, ``"dapo"``) against the reference code,
distillation from top-8 teacher logits precomputed at tp 4 (the global token share from the default all-reduce;
``max_grad_norm`` clipping: the norm equals torch's on the reference, which it clips);
negative controls: a divisor of the microbatch's own pair count, raw rewards as advantages. The objectives refuse the
pipelined model (no logits), train_step refuses an objective with no pipelined form and a full-vocabulary teacher.

LoRA (``peft``, tp 2 x dp 2 ZeRO-3; a plain-peft adapter with random A and B): DPO, GRPO and top-8 distillation equal
plain peft on plain transformers (losses and every adapter piece); negative control: DPO against the LoRA policy as
its own reference.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models import post_training as pt
from tests.helpers import post_training as ref
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import assert_params_match

# eps 1e-4, not the suite's 1e-5: with sharper tiny models some gradients are float noise (~1e-7) that AdamW's
# g / (|g| + eps) would turn into 1e-5-sized parameter differences (seen: 4.6e-5 on one of 3072 elements)
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-4)

STEPS = 3
TOL = dict(atol=1e-5, rtol=1e-5)


def _policy(path, **parallel):
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False).train()


def _plain(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path).train()


def _trainable(model) -> list:
    return [param for param in model.parameters() if param.requires_grad]  # LoRA: the adapters alone


def _prepared(model, zero_stage: int = 3):
    from accelerate import Accelerator

    optimizer = torch.optim.AdamW(_trainable(model), **ADAMW)
    return om.training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=zero_stage)


def _train(model, objective, local: dict, reference_loss, reference_model, *, steps=STEPS, check=True,
           pipelined=False, params_match=assert_params_match, **options):
    """``steps`` of ``objective`` on this replica's batch against ``reference_loss()`` (the global batch's loss of
    ``reference_model``, stepped with AdamW too); returns the per-step (got, expected) losses. ``pipelined``: the
    model steps through its own schedule (no ZeRO wrapper); ``params_match(model, reference)`` compares the trained
    parameters at the end."""
    inner = model
    if pipelined:
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    else:
        model, optimizer = _prepared(model)
    ref_optimizer = torch.optim.AdamW(_trainable(reference_model), **ADAMW)
    losses = []
    for step in range(steps):
        breadcrumb(f"{objective.__name__} step {step}")
        got, metrics = pt.train_step(model, optimizer, objective, local, **options)
        expected = reference_loss()
        expected.backward()
        if options.get("max_grad_norm"):  # the whole model's norm, clipped like torch's on the reference
            norm = torch.nn.utils.clip_grad_norm_(_trainable(reference_model), options["max_grad_norm"])
            if check:
                torch.testing.assert_close(metrics["grad_norm"], norm, **TOL)
                assert norm > options["max_grad_norm"]
        ref_optimizer.step(), ref_optimizer.zero_grad()
        losses.append((got.item(), expected.item()))
        if check:
            torch.testing.assert_close(got, expected.detach(), **TOL, msg=f"{objective.__name__} step {step}")
    if check:
        params_match(inner, reference_model)
    return losses


def _dpo(paths) -> None:
    vocab = 101
    batch = ref.preference_batch(vocab, pairs=4, seq=10, seed=0)
    frozen = _policy(paths["llama"], tensor_parallel_size=4).eval()  # the reference at its own layout
    plain_ref = _plain(paths["llama"]).eval()
    for loss_type, parallel in (("sigmoid", dict(sequence_parallel=True)), ("ipo", {})):
        model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2, **parallel)
        ctx = model.parallel_context
        local = ref.replica(batch, ctx.dp_rank, ctx.dp_size, paired=True)
        reference = _plain(paths["llama"])
        _train(model, pt.dpo_objective, local,
               lambda reference=reference, loss_type=loss_type: ref.dpo_reference_loss(
                   reference, plain_ref, batch, 0.1, loss_type), reference,
               reference=frozen, beta=0.1, loss_type=loss_type)
    # length-normalized DPO against precomputed reference log-probabilities (computed by the frozen model once)
    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    ctx = model.parallel_context
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size, paired=True)
    chosen, rejected = pt.reference_log_probs(frozen, local).chunk(2)
    precomputed = dict(local, ref_chosen_logps=chosen, ref_rejected_logps=rejected)
    reference = _plain(paths["llama"])
    _train(model, pt.dpo_objective, precomputed,
           lambda: ref.dpo_reference_loss(reference, plain_ref, batch, 0.1, "sigmoid_norm"), reference,
           beta=0.1, loss_type="sigmoid_norm")
    # negative control: the "reference" is the trained policy itself, so it moves with the steps
    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    reference = _plain(paths["llama"])
    losses = _train(model, pt.dpo_objective, local, lambda: ref.dpo_reference_loss(
        reference, plain_ref, batch, 0.1, "sigmoid"), reference, check=False, reference=model, beta=0.1)
    assert abs(losses[0][0] - losses[0][1]) < 1e-5  # the same weights at step 1
    assert max(abs(a - b) for a, b in losses[1:]) > 1e-4, losses


def _grpo(paths) -> None:
    vocab, generations = 101, 4
    rollout = ref.rollout_batch(vocab, prompts=4, generations=generations, prompt_len=4, completion_len=6, seed=1)
    advantages = ref.group_advantages(rollout["rewards"], generations)
    global_tokens = rollout["completion_mask"].sum()
    plain_ref = _plain(paths["llama"]).eval()
    for loss_type in ("grpo", "dapo"):
        model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
        frozen = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2).eval()
        ctx = model.parallel_context
        local = ref.replica(rollout, ctx.dp_rank, ctx.dp_size)
        local["advantages"] = pt.group_advantages(local.pop("rewards"), generations)
        torch.testing.assert_close(local["advantages"], advantages.chunk(ctx.dp_size)[ctx.dp_rank], **TOL)
        options = {}
        if loss_type == "dapo":
            options["num_items_in_batch"] = global_tokens.float() / ctx.dp_size
        reference = _plain(paths["llama"])
        _train(model, pt.grpo_objective, local, lambda reference=reference, loss_type=loss_type: (
            ref.grpo_reference_loss(reference, plain_ref, rollout, advantages, 0.04, 0.7, loss_type,
                                    num_items=global_tokens)), reference,
               reference=frozen, beta=0.04, temperature=0.7, loss_type=loss_type, **options)
    # negative control: the raw rewards as advantages (not group-normalized)
    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    ctx = model.parallel_context
    local = ref.replica(rollout, ctx.dp_rank, ctx.dp_size)
    local["advantages"] = local.pop("rewards")
    reference = _plain(paths["llama"])
    losses = _train(model, pt.grpo_objective, local, lambda: ref.grpo_reference_loss(
        reference, plain_ref, rollout, advantages, 0.0, 1.0, "grpo"), reference, steps=2, check=False)
    assert max(abs(a - b) for a, b in losses) > 1e-3, losses


def _sampling(paths) -> None:
    """GRPO on completions the policy samples itself at tp 2 x dp 2 (temperature, top-p; every rank seeded
    differently): the tp ranks of a replica get the same tokens, those of plain ``transformers`` seeded like tp rank
    0; one step on them (a toy reward: how many even ids) equals the reference code; RLOO's loss too."""
    import transformers

    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    ctx = model.parallel_context
    g = torch.Generator().manual_seed(7 + ctx.dp_rank)
    prompt_ids = torch.randint(3, 101, (2, 4), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, 0], prompt_mask[0, 0] = ref.PAD, 0
    options = dict(num_generations=3, max_new_tokens=5, eos_token_id=ref.EOS, pad_token_id=ref.PAD, temperature=0.9,
                   top_p=0.95)
    torch.manual_seed(100 + 10 * ctx.dp_rank + ctx.tp_rank)
    rollout = pt.generate_completions(model, prompt_ids, prompt_mask, **options)
    parts = [torch.empty_like(rollout["completion_ids"]) for _ in range(ctx.tp_size)]
    torch.distributed.all_gather(parts, rollout["completion_ids"], group=ctx.tp_group)
    assert all(torch.equal(parts[0], part) for part in parts)
    plain = _plain(paths["llama"]).eval()
    torch.manual_seed(100 + 10 * ctx.dp_rank)
    config = transformers.GenerationConfig(do_sample=True, max_new_tokens=5, temperature=0.9, top_p=0.95, top_k=0,
                                           eos_token_id=ref.EOS, pad_token_id=ref.PAD)
    expected = plain.generate(input_ids=prompt_ids.repeat_interleave(3, 0),
                              attention_mask=prompt_mask.repeat_interleave(3, 0), generation_config=config)
    completion = expected[:, prompt_ids.shape[1]:]
    assert torch.equal(rollout["completion_ids"][rollout["completion_mask"] == 1],
                       completion[rollout["completion_mask"] == 1])
    rewards = (rollout["completion_ids"] % 2 == 0).mul(rollout["completion_mask"]).sum(-1).float()
    rollout["advantages"] = pt.group_advantages(rewards, 3)
    whole = {}  # the global batch: both replicas' rollouts (equal completions per replica)
    for key, value in dict(rollout, rewards=rewards).items():
        parts = [torch.empty_like(value) for _ in range(ctx.dp_size)]
        torch.distributed.all_gather(parts, value.contiguous(), group=ctx.dp_group)
        whole[key] = torch.cat(parts)
    reference = _plain(paths["llama"])
    _train(model, pt.grpo_objective, rollout, lambda: ref.grpo_reference_loss(
        reference, None, whole, ref.group_advantages(whole["rewards"], 3), 0.0, 0.9, "grpo"), reference, steps=1,
           temperature=0.9)
    # every replica sampled its own prompts: the dp mean of the replicas' reference losses is the global loss
    got = pt.completion_log_probs(model, rollout)["log_probs"]
    want = ref.token_logps(reference, torch.cat([rollout["prompt_ids"], rollout["completion_ids"]], 1),
                           torch.cat([rollout["prompt_mask"], rollout["completion_mask"]], 1),
                           torch.cat([torch.zeros_like(prompt_mask.repeat_interleave(3, 0)),
                                      rollout["completion_mask"]], 1))[:, -5:]
    torch.testing.assert_close(got, want, **TOL)
    loss = pt.rloo_loss(got, pt.rloo_advantages(rewards, 3), rollout["completion_mask"])
    adv = rewards - (rewards.view(-1, 3).sum(1, keepdim=True) - rewards.view(-1, 3)).view(-1) / 2
    torch.testing.assert_close(loss, -(adv * torch.ones(())).mean(), **TOL)


def _distill_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (4, 10), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 7:] = 0
    attention[3, 5:] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :3] = -100  # a prompt
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def _distill(paths) -> None:
    vocab = 101
    batch = _distill_batch(vocab)
    labels = batch["labels"]
    count = (labels[:, 1:] != -100).sum()
    wide_teacher = _policy(paths["teacher"], tensor_parallel_size=4).eval()
    plain_wide = _plain(paths["teacher"]).eval()
    same_teacher = _policy(paths["llama_b"], tensor_parallel_size=2, data_parallel_size=2).eval()
    plain_same = _plain(paths["llama_b"]).eval()
    for teacher, plain_teacher, top_k, direction in ((wide_teacher, plain_wide, 8, "forward"),
                                                     (same_teacher, plain_same, None, "reverse")):
        model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
        ctx = model.parallel_context
        local = ref.replica(batch, ctx.dp_rank, ctx.dp_size)
        local["num_items_in_batch"] = count.float() / ctx.dp_size
        reference = _plain(paths["llama"])
        _train(model, pt.distill_objective, local, lambda reference=reference, t=plain_teacher, k=top_k, d=direction: (
            ref.distill_reference_loss(reference, t, batch, alpha=0.6, direction=d, temperature=2.0, top_k=k,
                                       count=count)), reference,
               teacher=teacher, top_k=top_k, alpha=0.6, direction=direction, temperature=2.0)
    # a teacher split otherwise (tp 4) without top_k: ValueError before any forward
    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    with pytest.raises(ValueError, match="top_k"):
        pt.distill_objective(model, ref.replica(batch, 0, 2), teacher=wide_teacher)
    # negative control: the same loss with the KL over this rank's vocabulary columns only
    model = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
    ctx = model.parallel_context
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size)
    logits, shard = pt.local_logits(model, local["input_ids"], local["attention_mask"])
    with torch.no_grad():
        teacher_logits, _ = pt.local_logits(same_teacher, local["input_ids"], local["attention_mask"])
    targets = torch.nn.functional.pad(local["labels"][:, 1:], (0, 1), value=-100)
    right, _ = pt.distillation_loss(logits, targets, shard=shard, teacher_logits=teacher_logits, alpha=1.0)
    wrong, _ = pt.distillation_loss(logits, targets, shard=om.losses.VocabShard(vocab_start=shard.vocab_start),
                                    teacher_logits=teacher_logits, alpha=1.0)
    assert (right - wrong).abs() > 1e-3, (right.item(), wrong.item())


def _pipeline(paths) -> None:
    """pp 2 x dp 2 (two microbatches per replica): DPO, GRPO and distillation run as the last stage's loss and equal
    the reference code over 3 AdamW steps; frozen models sit unpipelined at tp 4 and are run before each step."""
    pp = dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    frozen = _policy(paths["llama"], tensor_parallel_size=4).eval()
    plain_ref = _plain(paths["llama"]).eval()
    model = _policy(paths["llama"], **pp)
    batch = ref.preference_batch(101, pairs=4, seq=10, seed=0)
    with pytest.raises(NotImplementedError, match="pipelined"):  # its forward returns no logits
        pt.dpo_objective(model, batch, reference=frozen, beta=0.1)
    with pytest.raises(NotImplementedError, match="no pipelined form"):
        pt.train_step(model, None, lambda m, b: None, batch)
    ctx = model.parallel_context
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size, paired=True)  # 2 pairs: one per microbatch
    for loss_type in ("sigmoid", "ipo"):
        model = _policy(paths["llama"], **pp)
        reference = _plain(paths["llama"])
        _train(model, pt.dpo_objective, local, lambda reference=reference, loss_type=loss_type: (
            ref.dpo_reference_loss(reference, plain_ref, batch, 0.1, loss_type)), reference, pipelined=True,
               reference=frozen, beta=0.1, loss_type=loss_type)
    # negative control: each microbatch's own pair mean (a divisor of 1 pair, not the replica's share of 2)
    model = _policy(paths["llama"], **pp)
    reference = _plain(paths["llama"])
    losses = _train(model, pt.dpo_objective, local, lambda: ref.dpo_reference_loss(
        reference, plain_ref, batch, 0.1, "sigmoid"), reference, steps=1, check=False, pipelined=True,
                    reference=frozen, beta=0.1, num_pairs_in_batch=1.0)
    assert abs(losses[0][0] - losses[0][1]) > 1e-2, losses

    generations = 4
    rollout = ref.rollout_batch(101, prompts=4, generations=generations, prompt_len=4, completion_len=6, seed=1)
    advantages = ref.group_advantages(rollout["rewards"], generations)
    global_tokens = rollout["completion_mask"].sum()
    local = ref.replica(rollout, ctx.dp_rank, ctx.dp_size)  # 8 completions: one group per microbatch
    local["advantages"] = pt.group_advantages(local.pop("rewards"), generations)
    for loss_type in ("grpo", "dapo"):
        model = _policy(paths["llama"], **pp)
        options = dict(num_items_in_batch=global_tokens.float() / ctx.dp_size) if loss_type == "dapo" else {}
        reference = _plain(paths["llama"])
        _train(model, pt.grpo_objective, local, lambda reference=reference, loss_type=loss_type: (
            ref.grpo_reference_loss(reference, plain_ref, rollout, advantages, 0.04, 0.7, loss_type,
                                    num_items=global_tokens)), reference, pipelined=True,
               reference=frozen, beta=0.04, temperature=0.7, loss_type=loss_type, **options)
    # negative control: the raw rewards as advantages
    model = _policy(paths["llama"], **pp)
    wrong = dict(local, advantages=ref.replica(rollout, ctx.dp_rank, ctx.dp_size)["rewards"])
    reference = _plain(paths["llama"])
    losses = _train(model, pt.grpo_objective, wrong, lambda: ref.grpo_reference_loss(
        reference, plain_ref, rollout, advantages, 0.0, 1.0, "grpo"), reference, steps=2, check=False,
                    pipelined=True)
    assert max(abs(a - b) for a, b in losses) > 1e-3, losses

    batch = _distill_batch(101)
    count = (batch["labels"][:, 1:] != -100).sum()
    teacher = _policy(paths["teacher"], tensor_parallel_size=4).eval()
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size)
    local["teacher_values"], local["teacher_indices"] = pt.teacher_topk(teacher, local, 8)  # precomputed top-k
    model = _policy(paths["llama"], **pp)
    reference = _plain(paths["llama"])
    plain_teacher = _plain(paths["teacher"]).eval()
    _train(model, pt.distill_objective, local, lambda: ref.distill_reference_loss(
        reference, plain_teacher, batch, alpha=0.6, direction="forward", temperature=2.0, top_k=8, count=count),
           reference, pipelined=True, alpha=0.6, direction="forward", temperature=2.0, max_grad_norm=0.5)
    with pytest.raises(ValueError, match="top-k"):  # a full-vocabulary teacher would cross the pipeline
        pt.train_step(model, None, pt.distill_objective, ref.replica(batch, ctx.dp_rank, ctx.dp_size),
                      teacher=teacher)


def _lora(paths) -> None:
    """peft LoRA on the policy / student at tp 2 x dp 2 ZeRO-3 (a plain-peft adapter with random A and B, sliced on
    load; base weights frozen): DPO, GRPO (fixed completions) and top-k distillation over 3 AdamW steps equal plain
    peft on plain transformers with the reference code (losses and every adapter piece); the frozen reference and
    teacher are base models at tp 4. Negative control: DPO against the LoRA policy itself as its reference."""
    import peft

    from oslo_models import adapters
    from oslo_models.post_training.log_probs import base_model_of
    from tests.adapters.test_lora import assert_adapters_match

    def ours():
        base = _policy(paths["llama"], tensor_parallel_size=2, data_parallel_size=2)
        return adapters.load_adapter(base, paths["adapter"], is_trainable=True)

    def plain():
        return peft.PeftModel.from_pretrained(_plain(paths["llama"]), paths["adapter"], is_trainable=True).train()

    frozen = _policy(paths["llama"], tensor_parallel_size=4).eval()
    plain_ref = _plain(paths["llama"]).eval()
    batch = ref.preference_batch(101, pairs=4, seq=10, seed=0)
    model = ours()
    ctx = base_model_of(model).parallel_context
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size, paired=True)
    reference = plain()
    _train(model, pt.dpo_objective, local, lambda: ref.dpo_reference_loss(reference, plain_ref, batch, 0.1, "sigmoid"),
           reference, params_match=assert_adapters_match, reference=frozen, beta=0.1)
    model = ours()
    reference = plain()
    losses = _train(model, pt.dpo_objective, local, lambda: ref.dpo_reference_loss(
        reference, plain_ref, batch, 0.1, "sigmoid"), reference, steps=2, check=False, reference=model, beta=0.1)
    assert max(abs(a - b) for a, b in losses[1:]) > 1e-4, losses

    generations = 4
    rollout = ref.rollout_batch(101, prompts=4, generations=generations, prompt_len=4, completion_len=6, seed=1)
    advantages = ref.group_advantages(rollout["rewards"], generations)
    local = ref.replica(rollout, ctx.dp_rank, ctx.dp_size)
    local["advantages"] = pt.group_advantages(local.pop("rewards"), generations)
    model = ours()
    reference = plain()
    _train(model, pt.grpo_objective, local, lambda: ref.grpo_reference_loss(
        reference, plain_ref, rollout, advantages, 0.04, 0.7, "grpo"), reference, params_match=assert_adapters_match,
           reference=frozen, beta=0.04, temperature=0.7)

    batch = _distill_batch(101)
    count = (batch["labels"][:, 1:] != -100).sum()
    local = ref.replica(batch, ctx.dp_rank, ctx.dp_size)
    local["num_items_in_batch"] = count.float() / ctx.dp_size
    teacher = _policy(paths["teacher"], tensor_parallel_size=4).eval()
    plain_teacher = _plain(paths["teacher"]).eval()
    model = ours()
    reference = plain()
    _train(model, pt.distill_objective, local, lambda: ref.distill_reference_loss(
        reference, plain_teacher, batch, alpha=0.6, direction="forward", temperature=2.0, top_k=8, count=count),
           reference, params_match=assert_adapters_match, teacher=teacher, top_k=8, alpha=0.6, direction="forward",
           temperature=2.0)


def _worker(paths) -> None:
    torch.manual_seed(0)
    _pipeline(paths)
    _dpo(paths)
    _grpo(paths)
    _sampling(paths)
    _distill(paths)
    if paths.get("adapter"):
        _lora(paths)


def test_post_training_objectives_match_reference_at_tp2_dp2_zero3(tmp_path):
    from tests.helpers.decoders import save_tiny

    sharp = dict(initializer_range=0.2)  # logits of std ~1.5, not near-uniform: a wrong vocabulary shows
    paths = {"llama": save_tiny(tmp_path / "llama", "llama", **sharp),
             "llama_b": save_tiny(tmp_path / "llama_b", "llama", seed=1, **sharp),
             "teacher": save_tiny(tmp_path / "teacher", "llama", seed=2, hidden_size=96, intermediate_size=128,
                                  num_hidden_layers=3, **sharp)}
    paths["adapter"] = _save_adapter(paths["llama"], tmp_path / "adapter")
    run_distributed(_worker, 4, paths, timeout=900)


def _save_adapter(base: str, folder) -> str | None:
    """A plain-peft LoRA adapter on ``base`` with random A and B (``init_lora_weights=False``: B is not 0, so the
    first step's gradients reach A), saved; ``None`` without peft (the LoRA part is skipped)."""
    try:
        import peft
    except ImportError:
        return None
    torch.manual_seed(1)
    model = peft.get_peft_model(_plain(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "gate_proj"], init_lora_weights=False))
    model.save_pretrained(str(folder))
    return str(folder)
