"""Routers whose rule differs from ``TopKRouter``'s softmax-then-top-k, as classes of their own (same
``forward(x [T, h]) -> (logits [T, E], weights [T, k], index [T, k])`` contract, so ``dispatch``/``combine`` and
``transformers``' router-logits recorder, which reads output 0, take them as they take ``TopKRouter``):

- ``GroupLimitedRouter`` (DeepSeek-V3, module ``gate``: ``weight [E, h]`` and the buffer
  ``e_score_correction_bias [E]``): logits in fp32, ``sigmoid`` scores; the choice adds the correction bias and is
  limited to the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of its two best biased
  scores); the weights are the *unbiased* scores of the chosen experts, renormalized with ``norm_topk_prob``, times
  ``routed_scaling_factor``. ``transformers``' ``DeepseekV3TopkRouter`` rule, step for step.
- ``BiasedTopKRouter`` (gpt-oss, module ``router``: ``weight [E, h]``, ``bias [E]``): logits in the input dtype with
  a bias, top-k of the logits, softmax over the k chosen in the logits' dtype (``GptOssTopKRouter``).

``e_score_correction_bias`` is DeepSeek's auxiliary-loss-free balancing bias. ``transformers`` keeps it as a
persistent buffer that no gradient and no optimizer touches (the original recipe updates it outside backprop from
the expert loads; ``transformers`` does not): here too it is a buffer, loaded from and saved to checkpoints under
the same key, frozen during training. ``reset_buffers`` zeroes it (``transformers``' initialization), so a
checkpoint without it starts from zeros.

Both routers are replicated over tensor and expert parallelism; their input is this rank's full tokens, so their
gradients need no reduction beyond data parallelism. No communication here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's sigmoid router with group-limited top-k. ``forward(x [T, h])`` -> ``(logits [T, E] fp32,
    weights [T, k] fp32, index [T, k])``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts={num_experts} must split into n_group={n_group} equal groups")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
        if top_k > topk_group * num_experts // n_group:
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the experts of topk_group={topk_group} groups")
        self.top_k, self.num_experts, self.hidden_dim = top_k, num_experts, hidden_size
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def reset_buffers(self) -> None:
        """Zero the correction bias (called after ``to_empty``; a checkpoint's value is loaded over it)."""
        self.e_score_correction_bias = torch.zeros_like(self.e_score_correction_bias, dtype=torch.float32)

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states.float(), self.weight.float())  # [T, E] fp32
        scores = logits.sigmoid()
        biased = scores + self.e_score_correction_bias  # the bias steers the choice only
        per_group = self.num_experts // self.n_group
        group_scores = biased.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_index = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_index, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~expert_mask.bool(), float("-inf"))
        index = torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weights = scores.gather(1, index)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, index


class BiasedTopKRouter(nn.Module):
    """gpt-oss's router: ``forward(x [T, h])`` -> ``(logits [T, E], weights [T, k], index [T, k])``, all in the
    input dtype (no fp32 upcast, as ``GptOssTopKRouter``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.num_experts, self.hidden_dim = top_k, num_experts, hidden_size
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
        top, index = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.softmax(top, dim=1, dtype=top.dtype), index
