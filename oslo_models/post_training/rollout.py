"""Sampled completions from the trained model itself, at its own layout, for GRPO / RLOO (and on-policy distillation).

:func:`generate_completions` repeats each prompt ``num_generations`` times (consecutive rows: a group), runs the
model's own ``generate`` (``transformers``' decode loop over the parallel model: every tensor-parallel rank runs the
same forward on the same prompts, and the sampling draws from tp rank 0's RNG state, broadcast once per call, so
every rank of the group samples the same tokens; see ``models/generation.py``) and cuts the completions at the first
EOS as TRL does (the mask covers the EOS itself, nothing after it).

Data-parallel replicas sample their own prompts (their own groups): nothing runs across them. Under ZeRO-3 the model's
root parameters stay gathered for the call (``generate`` does it). A pipelined model cannot generate
(``RuntimeError`` from ``generate``, before any collective).
"""
from __future__ import annotations

import torch

from .log_probs import base_model_of


@torch.no_grad()
def generate_completions(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, num_generations: int,
                         max_new_tokens: int, eos_token_id: int | list[int], pad_token_id: int,
                         temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                         do_sample: bool = True) -> dict:
    """A rollout batch: ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` (``B = prompts x num_generations``; prompts
    must be left padded), ``completion_ids [B, C]`` (``pad_token_id`` after the first EOS) and ``completion_mask
    [B, C]``. Every tensor-parallel rank returns the same tokens."""
    if num_generations < 1:
        raise ValueError(f"num_generations must be positive, got {num_generations}")
    if prompt_mask.shape != prompt_ids.shape:
        raise ValueError("prompt_mask must have prompt_ids' shape")
    if prompt_ids.shape[0] and bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError("prompts must be left padded (the last column is a real token in every row)")
    base = base_model_of(model)
    prompt_ids = prompt_ids.repeat_interleave(num_generations, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(num_generations, dim=0)
    was_training = base.training
    base.eval()
    try:
        out = base.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=max_new_tokens,
                            do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    finally:
        base.train(was_training)
    completion_ids = out[:, prompt_ids.shape[1]:]
    eos = torch.as_tensor(eos_token_id, device=completion_ids.device).reshape(-1)
    is_eos = torch.isin(completion_ids, eos)
    first = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], is_eos.shape[1],
                                                                                 dtype=torch.long))
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    completion_mask = (positions.unsqueeze(0) <= first.unsqueeze(1)).long()
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask}
