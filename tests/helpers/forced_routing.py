"""Low-precision mixture-of-experts layouts compared with the reference's routing decisions forced onto the parallel
model (``ForcedRouting``).

Why. A router's top-k is a discrete decision. Under bf16/fp16 the parallel model reduces partial sums in another
order than ``transformers`` (tp's all-reduce, the experts' combine), so its router logits differ from the
reference's by a few units in the last place; a token whose k-th and (k+1)-th probabilities are that close goes to
another expert (``benchmarks/moe_routing_ties.py``: 3 of 4096 decisions at tp 2 under bf16, each a tie within
1.8e-4, none in fp32). That token's expert and router gradients then differ by its whole contribution, which no
rounding-level tolerance bounds. So, for these layouts only, the parallel model routes every token where the
reference routed it; everything else (the router's logits and weights, the dispatch, the expert-parallel all-to-all,
the experts, the combine, the load-balancing loss, the gradient reductions) is the model's own and is compared
as for every layout. The load-balancing loss is left out of these comparisons (``output_router_logits=False`` on
both sides): ``transformers`` computes it with its own top-k of the logits, which would flip at the same ties, and
one flip moves an expert's assignment fraction by ``1/(tokens*k)``. The router's own top-k and that loss are compared
unforced in every fp32 layout.

How. Forward hooks (a public ``nn.Module`` API; nothing is patched) on every router (``TopKRouter``, module
``...mlp.gate``) of both models:

- the reference's record, per step, each router's input tokens ``[T, h]`` and its chosen experts ``[T, k]``;
- the parallel model's find each of its tokens among the reference's tokens of the same router and step (nearest in
  L2: a rank holds some of the reference's tokens, whichever the layout, data, sequence or expert parallel, and its
  copy differs only by rounding), take that token's experts, and recompute the routing weights from the parallel
  model's own logits at those experts (softmax in fp32, gathered, renormalized as the router does). A token with no
  reference token within ``MATCH_TOLERANCE`` of its norm fails the test: the match is checked, not assumed.

``flips`` counts the decisions the parallel model would have taken otherwise (reported, not asserted).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from oslo_models.parallel_layers.moe.router import TopKRouter

MATCH_TOLERANCE = 0.05  # a matched token's distance over its norm; rounding differences are ~1e-2 at bf16


class ForcedRouting:
    """Install on ``model`` (the parallel one, before any wrapper) and ``reference``; call ``begin_step`` before each
    step's reference forwards; ``remove`` at the end."""

    def __init__(self, model: torch.nn.Module, reference: torch.nn.Module):
        self.recorded: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self.flips = self.decisions = 0
        self.handles = []
        routers = {name: module for name, module in model.named_modules() if isinstance(module, TopKRouter)}
        if not routers:
            raise ValueError("ForcedRouting: the model has no TopKRouter")
        for name, router in routers.items():
            if router.softmax_after_topk or router.capacity is not None:
                raise ValueError(f"{name}: ForcedRouting recomputes the weights of a softmax-then-top-k router only")
            self.handles.append(reference.get_submodule(name).register_forward_hook(self._recorder(name)))
            self.handles.append(router.register_forward_hook(self._forcer(name)))

    def begin_step(self) -> None:
        self.recorded.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _recorder(self, name: str):
        def record(module, args, output):
            tokens = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            self.recorded[name].append((tokens, output[2].detach()))
        return record

    def _forcer(self, name: str):
        @torch.compiler.disable  # data-dependent lookup against tensors recorded outside the graph
        def force(router: TopKRouter, args, output):
            logits, _, own_index = output
            if not self.recorded[name]:
                raise AssertionError(f"{name}: no reference tokens recorded for this step (call begin_step first, "
                                     "then run the reference before the model)")
            candidates = torch.cat([tokens for tokens, _ in self.recorded[name]])
            choices = torch.cat([index for _, index in self.recorded[name]])
            tokens = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            distance = torch.cdist(tokens, candidates)
            nearest = distance.argmin(dim=1)
            relative = distance.gather(1, nearest[:, None]).squeeze(1) / tokens.norm(dim=1).clamp_min(1e-12)
            if (worst := relative.max().item()) > MATCH_TOLERANCE:
                raise AssertionError(f"{name}: a token is {worst:.3g} of its norm from every reference token")
            index = choices[nearest].to(own_index.device)
            self.flips += int((index.sort(dim=1).values != own_index.sort(dim=1).values).any(dim=1).sum())
            self.decisions += index.shape[0]
            weights = torch.softmax(logits.float(), dim=-1).gather(1, index)
            if router.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if router.weights_in_logits_dtype:
                weights = weights.to(logits.dtype)
            return logits, weights, index
        return force
