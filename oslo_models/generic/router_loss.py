"""The load-balancing loss of a generic MoE causal LM under context parallelism: the replica's, not the chunk's.

``transformers``' MoE causal LMs (OLMoE, Qwen3-Next, MiniMax-M2, ERNIE 4.5, Granite 4, FlexOlmo, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok, attention_mask)``
to the loss when ``output_router_logits`` is set. The loss is a product of per-expert token means over the whole
batch, not a sum of per-token terms, so under context parallelism each rank's copy, computed from its chunk of every
sequence (and without the padding mask, which the context-parallel hook replaces), is not the replica's. As the
native families do (``context_parallel.sum_over_replica_tokens``), the generic path makes it the replica's: a forward
hook on the model all-gathers every layer's router logits and the chunk's padding mask over cp (backward: the
logits' gradients all-reduced over cp and sliced, so the ``dp x cp`` gradient average counts the replica's term
once per replica),
calls the model's own ``load_balancing_loss_func`` (the function of its modeling module, as its forward does) on the
replica's tokens, and replaces the chunk's term in ``loss`` and ``aux_loss`` with it. Across data-parallel replicas
each keeps its own term, as with data parallelism alone and as the native families do.

A model whose forward adds a router loss this hook does not know (no ``load_balancing_loss_func`` in its module, or
no ``num_experts`` / ``num_experts_per_tok`` / ``router_aux_loss_coef`` attributes) is refused at load when
``output_router_logits`` is set (:func:`check`). Layouts: each layer's router logits ``[b * s_chunk, E]`` (or
``[b, s_chunk, E]``), the padding mask ``[b, s_chunk]``. Collectives per forward with a router loss: one all-gather
over cp per MoE layer and one of the mask (backward: an all-reduce per layer).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


def _loss_function(model: nn.Module):
    """The model's own load-balancing function (of its modeling module), or ``None``."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def applies(model: nn.Module) -> bool:
    """The model adds a router loss (``output_router_logits``) the hook knows how to recompute."""
    return _loss_function(model) is not None and all(hasattr(model, name) for name in _ATTRIBUTES)


def check(model: nn.Module, context) -> None:
    """``NotImplementedError`` for a model whose router loss is on and cannot be made the replica's under cp."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "output_router_logits", False) and not applies(model):
        raise NotImplementedError(f"context_parallel_size={context.cp_size}: {type(model).__name__} adds a router "
                                  f"loss (output_router_logits=True) that the generic path cannot compute over the "
                                  f"whole sequence (no load_balancing_loss_func with num_experts / "
                                  f"num_experts_per_tok / router_aux_loss_coef); set output_router_logits=False")


class _GatherOverContext(torch.autograd.Function):
    """``[b, s_chunk, ...]`` -> the cp ranks' chunks concatenated along dim 1 (all-gather). Backward: the gradient
    summed over cp (all-reduce: every rank computed the same replica term), this rank's part."""

    @staticmethod
    def forward(ctx, tensor, group, rank: int, size: int):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.size = group, rank, size
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


def _gathered(tensor: torch.Tensor, context) -> torch.Tensor:
    return _GatherOverContext.apply(tensor, context.cp_group, context.cp_rank, context.cp_size)


def replica_router_loss(model: nn.Module, context, router_logits, padding, batch: int, seq: int,
                        function=None) -> torch.Tensor:
    """The load-balancing loss of the replica's tokens (every cp rank's chunks) from this rank's router logits
    (``function``: the model's ``load_balancing_loss_func``, looked up from its class when not given)."""
    layers = []
    for logits in router_logits:
        whole = _gathered(logits.reshape(batch, seq, -1), context)  # [b, s_chunk * cp, E]
        layers.append(whole.reshape(batch * seq * context.cp_size, -1))
    mask = None
    if padding is not None:
        mask = _gathered(padding.to(layers[0].device), context)  # [b, s_chunk * cp], in the same order
    function = function or _loss_function(model)
    return function(tuple(layers), model.num_experts, model.num_experts_per_tok, mask)


class ReplicaRouterLoss:
    """The forward hook of the module docstring; ``keyword`` names the context-parallel call object in the forward's
    keyword arguments (it carries the chunk's padding mask)."""

    def __init__(self, context, keyword: str, function):
        self.context, self.keyword, self.function = context, keyword, function  # (FSDP2 later renames the class)

    def __call__(self, module, args, kwargs, output):
        aux = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if aux is None or not logits:
            return output
        ids = args[0] if args else kwargs.get("input_ids")
        shape_like = ids if ids is not None else kwargs["inputs_embeds"]
        batch, seq = shape_like.shape[:2]
        replica = replica_router_loss(module, self.context, logits, kwargs[self.keyword].padding, batch, seq,
                                      self.function)
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + module.router_aux_loss_coef * (replica - aux).to(output.loss.device)
        output.aux_loss = replica
        return output


def install(model: nn.Module, context, keyword: str) -> None:
    """Refuse what cannot be made the replica's (:func:`check`), else register :class:`ReplicaRouterLoss`."""
    check(model, context)
    if applies(model):
        model.register_forward_hook(ReplicaRouterLoss(context, keyword, _loss_function(model)), with_kwargs=True)


# ---------------------------------------------------------------------------------------------- pipeline stages
# Under pipeline parallelism the MoE layers sit on different stages, and the load-balancing loss is a product of sums
# over all of them (``E * sum_e f_e * P_e``), so no stage can add its share alone. As for the native MoE families
# (``models/mixtral/pipeline_mixtral.py``, Megatron-Core's rule), each stage adds its layers' routing statistics
# (``[2E + 1]`` fp32: top-k assignment counts, router probability sums, token rows, padding weighted) to the ones it
# received and sends them on beside the hidden states; the last stage computes the loss from the totals. Gradients
# flow back through the probability sums. Each microbatch's term is its own (``router_aux_loss_coef * aux / M`` per
# microbatch of ``M``), as gradient accumulation over the microbatches computes it in ``transformers``.


def pipeline_router_loss(model: nn.Module) -> bool:
    """The pipelined model adds a load-balancing loss: ``output_router_logits`` set and a loss this module can carry
    across stages (:func:`check_pipeline` ran at load)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(text, "output_router_logits", False)) and applies(model)


def router_recorder(model: nn.Module):
    """``transformers``' own record of where the router logits come from (``_can_record_outputs['router_logits']``
    of the decoder: an ``OutputRecorder`` with the router class and the output index), or ``None``."""
    for module in model.modules():
        found = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if found is not None:
            return found
    return None


def check_pipeline(model: nn.Module) -> None:
    """At load, for a pipelined model with ``output_router_logits``: the router modules are known to
    ``transformers``' output recorder, and the model's own ``load_balancing_loss_func`` equals the statistics rule on
    random router logits and padding (else ``NotImplementedError`` with the reason). No collective."""
    from ..models.mixtral.pipeline_mixtral import aux_loss_from_statistics, routing_statistics

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(text, "output_router_logits", False):
        return
    name = type(model).__name__
    if not applies(model):
        raise NotImplementedError(f"pipeline_parallel_size > 1: {name} has output_router_logits=True but no "
                                  f"load_balancing_loss_func with num_experts / num_experts_per_tok / "
                                  f"router_aux_loss_coef the stages could carry; set output_router_logits=False")
    recorder = router_recorder(model)
    if recorder is None or getattr(recorder, "target_class", None) is None:
        raise NotImplementedError(f"pipeline_parallel_size > 1: {name} adds a router loss (output_router_logits) but "
                                  f"transformers records no router modules for it; set output_router_logits=False")
    experts, top_k = model.num_experts, model.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(12, experts, generator=generator) for _ in range(2)]
    padding = (torch.rand(3, 4, generator=generator) > 0.3).long()
    for mask in (padding, None):
        own = _loss_function(model)(tuple(logits), experts, top_k, mask)
        carried = aux_loss_from_statistics(routing_statistics(logits, experts, top_k, mask), experts)
        if not torch.allclose(torch.as_tensor(own, dtype=torch.float32), carried, atol=1e-6, rtol=1e-5):
            raise NotImplementedError(
                f"pipeline_parallel_size > 1: {name}'s load_balancing_loss_func is not the product of summed routing "
                f"statistics the pipeline carries across stages ({float(own)} vs {float(carried)} on a test "
                f"input); set output_router_logits=False to pipeline it")


class StageRouterLogits:
    """Forward hooks on the router modules of some layers (``transformers``' recorded class), collecting the router
    logits ``[tokens, E]`` of one stage's forward; a context manager."""

    def __init__(self, model: nn.Module, layers):
        recorder = router_recorder(model)
        self.index = recorder.index
        self.modules = [module for layer in layers for module in layer.modules()
                        if isinstance(module, recorder.target_class)]
        self.logits: list[torch.Tensor] = []
        self.handles = []

    def _hook(self, module, args, output):
        value = output[self.index] if isinstance(output, (tuple, list)) else output
        self.logits.append(value.to_local() if hasattr(value, "to_local") else value)

    def __enter__(self):
        self.handles = [module.register_forward_hook(self._hook) for module in self.modules]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return False


def stage_statistics(model: nn.Module, logits: list[torch.Tensor], attention_mask, received):
    """The statistics after this stage: ``received`` (``[2E + 1]`` or ``None`` on the first stage) plus this stage's
    layers' (``logits``: each ``[mb * s, E]``; ``attention_mask`` ``[mb, s]`` or ``None``)."""
    from ..models.mixtral.pipeline_mixtral import routing_statistics

    experts = model.num_experts
    if not logits:
        mine = torch.zeros(2 * experts + 1, dtype=torch.float32,
                           device=received.device if received is not None else model.parallel_context.device)
    else:
        mine = routing_statistics([value.reshape(-1, experts) for value in logits], experts,
                                  model.num_experts_per_tok, attention_mask)
    return mine if received is None else received + mine


def microbatch_router_loss(model: nn.Module, statistics: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """``router_aux_loss_coef * aux / M``: this microbatch's term of the step's loss. Under context parallelism the
    statistics are the chunk's: they are summed over cp first (one all-reduce of ``[2E + 1]``, backward: summed over
    cp), and each cp rank adds ``1/cp`` of the term (the runner sums the cp ranks' losses), as the native MoE
    adapter does."""
    from ..models.mixtral.pipeline_mixtral import aux_loss_from_statistics

    context = model.parallel_context
    if context.cp_size > 1:
        from ..parallel_layers.context_parallel import sum_over_context

        statistics = sum_over_context(statistics, context)
    aux = aux_loss_from_statistics(statistics, model.num_experts) / context.cp_size
    return model.router_aux_loss_coef * aux / num_microbatches
