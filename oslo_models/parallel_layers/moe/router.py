"""Routers of mixture-of-experts layers and the losses ``transformers`` computes from their logits.

``TopKRouter`` (module name ``gate``, one ``weight [E, h]`` as ``MixtralTopKRouter``/``Qwen2MoeTopKRouter``):
logits in the input dtype, softmax in fp32, then top-k; the families differ in two switches:

- ``normalize``: divide the top-k probabilities by their sum (Mixtral always; Qwen2-MoE when ``norm_topk_prob``);
- ``weights_in_logits_dtype``: cast the routing weights back to the logits' dtype (Qwen2-MoE) or keep fp32
  (Mixtral).

``softmax_after_topk`` takes top-k of the logits first and softmaxes only the k chosen (the order used by e.g.
DeepSeek-style/Mixtral-"after" routers), and ``capacity`` drops assignments beyond a per-expert budget in token
order (Switch Transformers' token dropping; dropped entries get index ``-1`` and weight 0). Neither is used by
Mixtral or Qwen2-MoE, which are dropless.

The router weight is replicated (tensor and expert parallel); its input is this rank's full tokens, so its
gradient needs no reduction beyond data parallelism. Under the 2D / 2.5D grid its input is the whole tokens of
this rank's batch block (the MoE block gathers the hidden over the grid row), so its gradient is summed over the
grid's batch groups (``tensor_parallel_2d.replicated_over_batch``, backward only). No other communication here.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel_2d import replicated_over_batch


class TopKRouter(nn.Module):
    """``forward(x [T, h]) -> (logits [T, E], weights [T, k], index [T, k])``."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, normalize: bool = True,
                 weights_in_logits_dtype: bool = False, softmax_after_topk: bool = False,
                 capacity: int | None = None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.num_experts, self.hidden_dim = top_k, num_experts, hidden_size
        self.normalize, self.weights_in_logits_dtype = normalize, weights_in_logits_dtype
        self.softmax_after_topk, self.capacity = softmax_after_topk, capacity
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.grid = None  # 2D / 2.5D: the Grid (plan.GridReplicated), see the module docstring

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        weight = self.weight if self.grid is None else replicated_over_batch(self.weight, self.grid)
        logits = F.linear(hidden_states, weight)  # [T, E]
        if self.softmax_after_topk:
            top_logits, index = torch.topk(logits.float(), self.top_k, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, index = torch.topk(probs, self.top_k, dim=-1)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_logits_dtype:
            weights = weights.to(logits.dtype)
        if self.capacity is not None:
            weights, index = drop_over_capacity(weights, index, self.num_experts, self.capacity)
        return logits, weights, index


def drop_over_capacity(weights: torch.Tensor, index: torch.Tensor, num_experts: int, capacity: int,
                       group_size: int | None = None):
    """Keep at most ``capacity`` assignments per expert, first come first served in token order (for top-k, the
    first choices of all tokens before the second choices, as GShard/Switch). Dropped: index -1, weight 0.

    ``group_size``: the budget holds per group of that many consecutive tokens (``transformers``' Switch router:
    per sequence); ``None``: one group of all ``T`` tokens. ``weights``/``index``: ``[T, k]``."""
    top_k = index.shape[1]
    group_size = group_size or index.shape[0]
    if index.shape[0] % group_size:
        raise ValueError(f"{index.shape[0]} tokens do not split into groups of {group_size}")
    choice_major = index.view(-1, group_size, top_k).transpose(1, 2).reshape(-1, group_size * top_k)  # [G, k*g]
    one_hot = F.one_hot(choice_major, num_experts)  # [G, k*g, E]
    position = (torch.cumsum(one_hot, dim=1) * one_hot).sum(-1)  # 1-based place in its expert's queue
    position = position.view(-1, top_k, group_size).transpose(1, 2).reshape(index.shape)
    keep = position <= capacity
    return weights * keep, torch.where(keep, index, torch.full_like(index, -1))


def router_jitter(hidden_states: torch.Tensor, noise: float, training: bool) -> torch.Tensor:
    """Multiplicative uniform noise in ``[1 - noise, 1 + noise]`` on the layer input while training (Mixtral's
    ``router_jitter_noise``; it reaches the experts too, as there). Uses the default torch generator."""
    if not training or noise <= 0:
        return hidden_states
    return hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - noise, 1.0 + noise)


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, attention_mask=None):
    """The Switch load-balancing loss over all layers' logits, exactly as ``transformers`` computes it
    (``load_balancing_loss_func`` of Mixtral/Qwen2-MoE, called here, not copied): ``E * sum_e f_e * P_e`` with
    ``f_e`` the fraction of top-k assignments and ``P_e`` the mean probability of expert ``e`` over this rank's
    (non-padding) tokens."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(tuple(router_logits), num_experts, top_k, attention_mask)


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """Switch Transformers' z-loss: mean over tokens of ``logsumexp(logits)^2`` (``router_z_loss_func``)."""
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    return router_z_loss_func(router_logits)
