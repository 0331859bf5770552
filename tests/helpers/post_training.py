"""Batches and single-process reference code for the post-training tests: DPO, GRPO and distillation computed on the
whole vocabulary with ``torch.log_softmax`` on plain ``transformers`` models (TRL's formulas, written out)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

PAD, EOS = 0, 2


def preference_batch(vocab: int, pairs: int, seq: int, seed: int) -> dict:
    """``pairs`` chosen rows then ``pairs`` rejected rows, right padded to ``seq``: prompts of 2-4 tokens shared by a
    pair, completions of unequal lengths (``completion_mask`` 1 on them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((2 * pairs, seq), PAD)
    attention = torch.zeros(2 * pairs, seq, dtype=torch.long)
    completion = torch.zeros(2 * pairs, seq, dtype=torch.long)
    for i in range(pairs):
        prompt_len = 2 + i % 3
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
        for row, length in ((i, seq - prompt_len - i % 2), (pairs + i, seq - prompt_len - 2 - i % 3)):
            completion_ids = torch.randint(3, vocab, (length,), generator=g)
            ids[row, :prompt_len + length] = torch.cat([prompt, completion_ids])
            attention[row, :prompt_len + length] = 1
            completion[row, prompt_len:prompt_len + length] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def rollout_batch(vocab: int, prompts: int, generations: int, prompt_len: int, completion_len: int,
                  seed: int) -> dict:
    """Fixed completions: left-padded prompts repeated ``generations`` times, completions cut after an EOS at
    varying places (mask 1 up to and including it), and fixed rewards ``[B]``."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * generations
    prompt_ids = torch.randint(3, vocab, (prompts, prompt_len), generator=g).repeat_interleave(generations, 0)
    prompt_mask = torch.ones_like(prompt_ids)
    for row in range(0, rows, 2 * generations):  # every other group has a left-padded prompt
        prompt_ids[row:row + generations, 0] = PAD
        prompt_mask[row:row + generations, 0] = 0
    completion_ids = torch.randint(3, vocab, (rows, completion_len), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    for row in range(rows):
        end = 1 + (row * 3) % completion_len
        if end < completion_len:
            completion_ids[row, end - 1] = EOS
            completion_ids[row, end:] = PAD
            completion_mask[row, end:] = 0
    rewards = torch.randn(rows, generator=g)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "rewards": rewards}


def replica(batch: dict, dp_rank: int, dp_size: int, *, paired: bool = False) -> dict:
    """Data-parallel replica ``dp_rank``'s contiguous rows (a preference batch: its share of chosen and rejected)."""
    if not paired:
        return {k: v.chunk(dp_size)[dp_rank] for k, v in batch.items()}
    out = {}
    for key, value in batch.items():
        chosen, rejected = value.chunk(2)
        out[key] = torch.cat([chosen.chunk(dp_size)[dp_rank], rejected.chunk(dp_size)[dp_rank]])
    return out


def token_logps(model, input_ids, attention_mask, completion_mask, temperature: float = 1.0) -> torch.Tensor:
    """``[b, s - 1]``: full-vocabulary log-softmax of the next token, 0 outside the completion."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
    lp = F.log_softmax(logits / temperature, -1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp * completion_mask[:, 1:]


def dpo_reference_loss(policy, reference, batch: dict, beta: float, loss_type: str) -> torch.Tensor:
    """TRL's DPO loss (mean over the pairs) of one preference batch."""
    args = (batch["input_ids"], batch["attention_mask"], batch["completion_mask"])
    logps = token_logps(policy, *args).sum(-1)
    with torch.no_grad():
        ref = token_logps(reference, *args).sum(-1)
    chosen, rejected = (logps - ref).chunk(2)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen - rejected)).mean()
    lc, lr = batch["completion_mask"].sum(-1).float().chunk(2)
    delta = chosen / lc - rejected / lr
    if loss_type == "ipo":
        return ((delta - 1 / (2 * beta)) ** 2).mean()
    return -F.logsigmoid(beta * delta).mean()


def group_advantages(rewards: torch.Tensor, generations: int) -> torch.Tensor:
    grouped = rewards.view(-1, generations)
    mean = grouped.mean(1).repeat_interleave(generations)
    std = grouped.std(1).repeat_interleave(generations)
    return (rewards - mean) / (std + 1e-4)


def grpo_reference_loss(policy, reference, batch: dict, advantages: torch.Tensor, beta: float,
                        temperature: float, loss_type: str, num_items=None, eps: float = 0.2) -> torch.Tensor:
    """TRL ``GRPOTrainer``'s loss (on-policy: ``old = logp.detach()``) of one rollout batch."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    scored = torch.cat([torch.zeros_like(batch["prompt_mask"]), batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    logp = token_logps(policy, ids, attention, scored, temperature)[:, -width:]
    ratio = torch.exp(logp - logp.detach())
    adv = advantages.unsqueeze(1)
    loss_t = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    if beta:
        with torch.no_grad():
            ref = token_logps(reference, ids, attention, scored, temperature)[:, -width:]
        loss_t = loss_t + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    mask = batch["completion_mask"].float()
    if loss_type == "grpo":
        return ((loss_t * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    return (loss_t * mask).sum() / (mask.sum() if num_items is None else num_items)


def distill_reference_loss(student, teacher, batch: dict, *, alpha: float, direction: str, temperature: float,
                           top_k: int | None, count) -> torch.Tensor:
    """``alpha * KL + (1 - alpha) * CE`` summed over the batch's target tokens / ``count``."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    targets = batch["labels"][:, 1:]
    mask = (targets != -100).float()
    s = student(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    with torch.no_grad():
        t = teacher(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1].float()
    log_q = F.log_softmax(s / temperature, -1)
    if top_k is None:
        log_p = F.log_softmax(t / temperature, -1)
        if direction == "forward":
            kl = (log_p.exp() * (log_p - log_q)).sum(-1)
        else:
            kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    else:
        values, idx = t.topk(top_k, dim=-1)
        log_p = F.log_softmax(values / temperature, -1)
        if direction == "forward":
            kl = (log_p.exp() * (log_p - log_q.gather(-1, idx))).sum(-1)
        else:
            log_r = F.log_softmax((s / temperature).gather(-1, idx), -1)
            kl = (log_r.exp() * (log_r - log_p)).sum(-1)
    ce = -(F.log_softmax(s, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask)
    return (alpha * (kl * mask).sum() + (1 - alpha) * ce.sum()) / count
