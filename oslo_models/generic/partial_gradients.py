"""Replicated parameters whose gradient is partial under a tensor-parallel plan, found from the autograd graph and
summed over tp in the backward.

``transformers``' plans are written for inference: they name the projections to split and leave every other
parameter replicated. A replicated parameter that acts on a *sharded* activation - the scalars of a learnable
activation between a ``colwise`` and a ``rowwise`` projection (Apertus' xIELU ``alpha_p`` / ``alpha_n``), a per-head
norm over the local heads (``q_norm`` / ``k_norm``) - gets on each tp rank only the part of its gradient that comes
from that rank's slice. Stepped on it, the tp replicas drift apart silently (the loss stays right for a while).

The rule is structural, read from the graph the plan builds (no gradient values are compared):

1. One forward of ``model.dummy_inputs`` (``dummy_forward.py``: grad enabled, eval mode, the RNG state restored
   afterwards) records the autograd graph of the tensor-parallel model as it trains.
2. *Sharded* nodes: a ``to_local`` of a DTensor with a ``Shard`` / ``Partial`` placement on the tp mesh dimension (a
   colwise output, a local weight shard) is sharded, and so is every plain op that consumes a sharded node, up to
   the next boundary: a ``from_local`` (the rowwise input, where DTensor takes over) or ``transformers``'
   ``_AllReduceForward`` (a sum of partial outputs).
3. From the outputs back, each plain (non-DTensor) node gets the kind of the gradient that reaches it: *full* from
   the outputs, from DTensor code, from ``from_local`` and from ``transformers``' ``_AllReduceBackward``; *partial*
   from a sharded consumer; a plain consumer passes its own kind on; *mixed* where both meet.
4. A plain parameter (or a tp-replicated DTensor parameter used through ``to_local``) with a partial gradient is
   reduced: a tensor hook sums the gradient it receives over the tp group, in the backward, before it is accumulated
   (so gradient accumulation and FSDP2's reduce-scatter see the full gradient, and clipping reads the right norm).
   A *mixed* one (a replicated parameter fed by both replicated and sharded activations, which no single reduction
   fixes) is refused with ``NotImplementedError`` naming it.

``transformers``' ``replicated_with_grad_allreduce`` style marks some of these parameters by hand (and all-reduces
the *accumulated* gradient, which double counts under gradient accumulation); the generic path applies the plan
without those entries and lets this rule find them (``plan_marked`` are checked against it in the tests). Parameters
the dummy forward does not reach inherit the kind of the same parameter in another layer (``layers.*``); others are
left as the plan leaves them.

Collectives: the dummy forward's own (every tp rank runs it; the graph, and so the decision, is the same on all of
them); per backward, one all-reduce over tp per partial parameter.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from .dummy_forward import dummy_forward, refused_on_error

FULL, PARTIAL, MIXED = "full", "partial", "mixed"
_TO_LOCAL = "_ToTorchTensorBackward"
_FROM_LOCAL = "_FromTorchTensorBackward"
_SUM_FORWARD = "_AllReduceForwardBackward"  # transformers' forward all-reduce (identity backward)
_SUM_BACKWARD = "_AllReduceBackwardBackward"  # transformers' identity forward, all-reduce backward


def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _tp_dims(mesh) -> list[int]:
    names = getattr(mesh, "mesh_dim_names", None)
    if names:  # a named mesh: only its tp dimension (experts split over "ep" are whole on every tp rank)
        return [names.index("tp")] if "tp" in names else []
    return list(range(mesh.ndim)) if mesh.ndim == 1 else []


def _splits_over_tp(node) -> bool:
    """A ``to_local`` whose local tensor is a slice or a partial sum over the tp ranks."""
    spec = getattr(node, "dtensor_spec", None)
    if spec is None:
        return False
    return any(not spec.placements[dim].is_replicate() for dim in _tp_dims(spec.mesh))


def _graph(roots):
    """``(order, consumers)``: the nodes reachable from ``roots`` with each before its producers (a reverse
    topological order) and, for each node, the nodes consuming it."""
    consumers: dict = {}
    pending = {}  # node -> number of consumers not yet placed
    stack, seen = list(roots), set(roots)
    while stack:
        node = stack.pop()
        for producer, _ in node.next_functions:
            if producer is None:
                continue
            consumers.setdefault(producer, []).append(node)
            pending[producer] = pending.get(producer, 0) + 1
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    order, ready = [], [node for node in seen if node not in pending]
    while ready:
        node = ready.pop()
        order.append(node)
        for producer, _ in node.next_functions:
            if producer is None:
                continue
            pending[producer] -= 1
            if pending[producer] == 0:
                ready.append(producer)
    return order, consumers


def _sharded_and_dtensor(order) -> tuple[set, set]:
    """Nodes whose output is a tp slice (plain tensors), and nodes that compute on DTensors."""
    sharded, dtensor = set(), set()
    for node in reversed(order):  # producers first
        name = type(node).__name__
        producers = [p for p, _ in node.next_functions if p is not None]
        if name == _TO_LOCAL:
            if _splits_over_tp(node):
                sharded.add(node)
        elif name == _FROM_LOCAL:
            dtensor.add(node)
        elif name == "AccumulateGrad":
            if hasattr(node.variable, "placements"):
                dtensor.add(node)
        elif any(p in dtensor for p in producers):
            dtensor.add(node)
        elif name != _SUM_FORWARD and any(p in sharded for p in producers):
            sharded.add(node)
    return sharded, dtensor


def _declares_partial(node) -> bool:
    """A ``to_local(grad_placements=[Partial()])``: DTensor sums the gradient it receives over tp."""
    spec, placements = getattr(node, "dtensor_spec", None), getattr(node, "grad_placements", None)
    return spec is not None and placements is not None and any(
        placements[dim].is_partial() for dim in _tp_dims(spec.mesh))


def _contribution(consumer, kind: dict, sharded: set, dtensor: set) -> str:
    """The kind of gradient ``consumer`` sends to each plain node it consumes."""
    name = type(consumer).__name__
    if name in (_FROM_LOCAL, _SUM_BACKWARD):
        return FULL  # DTensor / transformers' all-reduce make the gradient whole
    if name == _TO_LOCAL:  # a DTensor parameter used as a local tensor
        return FULL if consumer in sharded or _declares_partial(consumer) else kind.get(consumer, FULL)
    if consumer in dtensor:
        return FULL
    if consumer in sharded:
        return PARTIAL  # a replicated tensor combined with a tp slice: each rank sees only its slice's part
    return kind.get(consumer, FULL)


def gradient_kinds(roots) -> dict:
    """``{leaf tensor: kind}`` for the leaves of the graph below ``roots`` (grad_fn nodes of the outputs) that are
    plain tensors or DTensors used through ``to_local`` without a split; see the module docstring."""
    order, consumers = _graph(roots)
    sharded, dtensor = _sharded_and_dtensor(order)
    kind: dict = {}
    for node in order:  # consumers first
        if node in sharded or node in dtensor and type(node).__name__ != "AccumulateGrad":
            continue
        found = {_contribution(consumer, kind, sharded, dtensor) for consumer in consumers.get(node, ())}
        if not consumers.get(node):
            found.add(FULL)  # an output
        kind[node] = MIXED if MIXED in found or {FULL, PARTIAL} <= found else found.pop()
    return {node.variable: kind[node] for node in kind if type(node).__name__ == "AccumulateGrad"}


def _output_nodes(output) -> list:
    tensors, stack = [], [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                tensors.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return tensors


def find_partial_parameters(model: nn.Module, context) -> dict[str, str]:
    """``{parameter name: kind}`` (``"partial"`` or ``"mixed"``) of the model's parameters whose gradient is not
    whole on every tp rank under its plan. Runs one forward of ``model.dummy_inputs`` (collective over tp)."""
    with refused_on_error(model, context):
        tensors = _output_nodes(dummy_forward(model, context, grad=True))
    sharded_outputs = [t for t in tensors if _splits_over_tp(t.grad_fn)]
    if sharded_outputs:
        raise NotImplementedError(
            f"{type(model).__name__}: its tensor-parallel plan leaves an output split over the tp ranks "
            f"(shape {tuple(sharded_outputs[0].shape)}); the generic path trains on whole outputs")
    kinds = gradient_kinds([t.grad_fn for t in tensors])
    by_tensor = {id(tensor): value for tensor, value in kinds.items()}
    found, seen_patterns = {}, {}
    names = dict(model.named_parameters())
    for name, param in names.items():
        if id(param) in by_tensor:
            seen_patterns.setdefault(_wildcard(name), set()).add(by_tensor[id(param)])
            if by_tensor[id(param)] != FULL:
                found[name] = by_tensor[id(param)]
    for name in names:  # not reached by the dummy forward: as the same parameter of another layer
        if name not in found and id(names[name]) not in by_tensor:
            pattern_kinds = seen_patterns.get(_wildcard(name), set()) - {FULL}
            if pattern_kinds:
                found[name] = MIXED if MIXED in pattern_kinds else PARTIAL
    return found


class ParameterGradientHooks:
    """A forward pre-hook for a module owning some parameters: on each forward with grad enabled it makes sure each
    such parameter object registered on the module now (FSDP2 swaps in its unsharded copies) has the tensor hook
    ``self.hook_for(param)``, which sees the parameter's incoming gradient before it is accumulated. Holds no state
    beyond the objects it hooked."""

    def __init__(self, names: list[str]):
        self.names = tuple(names)
        self.hooked: dict[str, torch.Tensor] = {}

    def hook_for(self, param: torch.Tensor):
        raise NotImplementedError

    def __call__(self, module, args):
        if not torch.is_grad_enabled():
            return
        for name in self.names:
            param = module._parameters.get(name)
            if param is not None and param.requires_grad and self.hooked.get(name) is not param:
                param.register_hook(self.hook_for(param))
                self.hooked[name] = param


class TensorParallelGradientSum(ParameterGradientHooks):
    """Sums each incoming gradient of its parameters over the tp ``group`` (one all-reduce per backward)."""

    def __init__(self, names: list[str], group):
        super().__init__(names)
        self.group = group

    def _sum(self, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        grad = grad.clone()
        local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
        dist.all_reduce(local, group=self.group)
        return grad

    def hook_for(self, param: torch.Tensor):
        return self._sum


def install_hooks(model: nn.Module, names, make) -> None:
    """Register ``make(attrs)`` (a ``ParameterGradientHooks``) as a forward pre-hook of each module owning some of the
    parameters ``names``, ``attrs`` its own parameters' names among them."""
    by_module: dict[str, list[str]] = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        by_module.setdefault(owner, []).append(attr)
    for owner, attrs in by_module.items():
        model.get_submodule(owner).register_forward_pre_hook(make(attrs))


def install_gradient_sums(model: nn.Module, names, group) -> None:
    """Sum the gradients of the parameters ``names`` over ``group`` (tp) in every backward (module pre-hooks)."""
    install_hooks(model, names, lambda attrs: TensorParallelGradientSum(attrs, group))


def reduce_partial_gradients(model: nn.Module, context) -> tuple[str, ...]:
    """Find the parameters with a partial gradient under the plan and sum their gradients over tp in the backward;
    ``NotImplementedError`` for a parameter whose gradient mixes whole and partial parts. Returns their names."""
    found = find_partial_parameters(model, context)
    mixed = sorted(name for name, value in found.items() if value == MIXED)
    if mixed:
        raise NotImplementedError(
            f"{type(model).__name__}: under its tensor-parallel plan the replicated parameter(s) {mixed[:4]} are fed "
            f"both by activations split over the tp ranks and by whole ones, so their gradient is neither whole nor "
            f"a sum of tp parts; use tensor_parallel_size=1 for this type")
    names = sorted(found)
    install_gradient_sums(model, names, context.tp_group)
    return tuple(names)
