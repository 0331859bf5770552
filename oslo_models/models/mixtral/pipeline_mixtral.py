"""Mixtral / Qwen2-MoE as pipeline stages: the shared stack's stages (``models/common/pipeline/pipeline_stack.py``) plus
the load-balancing loss carried across the cut.

``transformers``' load-balancing loss is ``E * sum_e f_e * P_e`` over *all* sparse layers' router outputs:
``f_e = (masked top-k assignments to e, summed over layers) / R`` and ``P_e = (masked router probabilities of e,
summed over layers) / R`` with ``R`` the masked token rows summed over layers. It is a product of two global sums,
so no stage can add its share on its own. As in Megatron-Core, each stage adds its layers' sums to a small fp32
tensor (``routing_statistics``: ``[2E + 1]`` = assignment counts ``[E]``, probability sums ``[E]``, rows ``[1]``)
received from the previous stage and sends the totals on beside the hidden states; the last stage computes the
loss from them (``aux_loss_from_statistics``). Gradients flow back through the probability sums, stage to stage
(the counts and rows are constants: top-k and the mask have no gradient).

Microbatches: the loss of a step is the token-weighted causal-LM loss of the whole batch (as for every family)
plus ``router_aux_loss_coef`` times the *mean over microbatches* of each microbatch's load-balancing loss (the
statistics never mix microbatches, as in Megatron). With one microbatch that is exactly ``transformers``' loss on
the batch; with several it is what gradient accumulation over those microbatches in ``transformers`` computes.
"""
from __future__ import annotations

import torch

from ..common.feed_forward.moe import RouterLogits
from ..common.pipeline.pipeline_stack import StackPipelineAdapter


def routing_statistics(router_logits, num_experts: int, top_k: int, attention_mask=None) -> torch.Tensor:
    """``[2E + 1]`` fp32: per expert the top-k assignment counts, then the router probability sums, then the
    token rows, each summed over ``router_logits`` (``[b*s, E]`` per layer) and weighted by ``attention_mask``
    (``[b, s]``; padding counts 0), as ``transformers``' ``load_balancing_loss_func`` accumulates them."""
    if not router_logits:
        raise ValueError("routing_statistics needs at least one layer's router logits")
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs, rows = torch.zeros_like(counts), counts.new_zeros(1)
    for logits in router_logits:
        weights = torch.softmax(logits, dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        mask = (counts.new_ones(logits.shape[0]) if attention_mask is None
                else attention_mask.reshape(-1).to(device=counts.device, dtype=torch.float32))
        counts = counts.scatter_add(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        probs = probs + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
        rows = rows + mask.sum()
    return torch.cat([counts.detach(), probs, rows.detach()])


def aux_loss_from_statistics(statistics: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The load-balancing loss from summed ``routing_statistics``: ``E * sum_e (counts_e / R) * (probs_e / R)``."""
    counts, probs, rows = statistics[:num_experts], statistics[num_experts:2 * num_experts], statistics[-1]
    return num_experts * torch.sum((counts / rows) * (probs / rows))


class MixtralPipelineAdapter(StackPipelineAdapter):
    """Stage forward: the shared stack's stage with a ``RouterLogits`` collector passed to every layer. Between
    stages: ``(hidden [mb, s, h], statistics [2E + 1] fp32)``; out of the last stage ``(local logits, statistics)``.
    Loss of microbatch ``i`` of ``M``: its causal-LM token losses / tokens of the batch +
    ``router_aux_loss_coef * aux_i / M`` (with ``output_router_logits``, as ``transformers`` adds the term).
    Per-layer parameter counts (sparse or dense feed-forward) come from the meta-built layers."""

    def _num_statistics(self, model) -> int:
        return 2 * type(model).num_experts(model.config) + 1

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        inputs, outputs = super().stage_io(model, layout, stage, microbatch, sequence_parallel)
        statistics = torch.empty(self._num_statistics(model), dtype=torch.float32, device="meta")
        return (inputs if stage == 0 else (*inputs, statistics)), (*outputs, statistics)

    def stage_forward(self, stage, x, statistics=None, attention_mask=None, position_ids=None):
        collected = RouterLogits()
        out = self.run_stage(stage, x, attention_mask, position_ids, router_logits=collected)
        config = stage.model_config
        num_experts = type(stage.owner).num_experts(config)
        if collected.logits:
            mine = routing_statistics(collected.logits, num_experts, config.num_experts_per_tok, attention_mask)
            statistics = mine if statistics is None else statistics + mine
        elif statistics is None:  # a first stage without sparse layers (Qwen2-MoE's mlp_only_layers)
            statistics = out.new_zeros(2 * num_experts + 1, dtype=torch.float32)
        return out, statistics

    def microbatch_loss(self, model, outputs, labels, num_items_in_batch, num_microbatches: int):
        logits, statistics = outputs
        loss = self.loss(model, logits, labels, num_items_in_batch)
        if not model.config.output_router_logits:
            return loss
        context = model.parallel_context
        if context.cp_size > 1:  # the whole sequence's statistics (backward x cp); the runner sums the cp ranks'
            from ...parallel_layers.context_parallel import sum_over_context  # losses: each adds 1/cp of the term

            statistics = sum_over_context(statistics, context)
        aux = aux_loss_from_statistics(statistics, type(model).num_experts(model.config)) / context.cp_size
        return loss + model.config.router_aux_loss_coef * aux.to(loss.dtype) / num_microbatches
