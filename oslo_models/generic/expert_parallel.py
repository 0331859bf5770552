"""Expert parallelism for ``transformers``' MoE blocks on the generic path: their own expert-parallel plan.

``transformers`` 5.x gives most MoE types a ``base_model_ep_plan``: the fused experts' weights ``grouped_gemm``
(``Shard(0)`` over the experts: whole experts per rank) and the experts module ``ep_dispatch_experts``, whose
all-to-all implementation sends each (token, expert) pair to the rank holding the expert and the results back, with
autograd all-to-alls (``transformers.distributed.expert_parallel``). The generic path applies that plan (on the meta
model, before ``transformers``' loader reads each rank's experts) over the ``ep`` dimension of a
``(one, pp, edp, ep, tp)`` DeviceMesh of the model's ranks: ``ep`` is carved out of ``dp x cp`` as for the native
families (``ParallelContext``: the data-parallel index ``d = e_dp * ep + e`` over ``dp`` and ``cp`` flattened, cp
innermost), so every rank keeps its own tokens and the experts of one ``ep`` group are split over it.

- **with tensor parallelism** the type's tp plan drops its entries for the experts (``transformers``' rule: an EP
  rule takes precedence over TP rules for the same modules, :func:`without_experts`); the router, the shared experts
  and the rest follow the tp plan. Each ep group is one tp rank's (its ranks differ in dp / cp only), and every tp
  rank of a replica routes the replica's whole batch (the dispatch's "ranks holding the same batch" is the size-1
  ``one`` dimension: ``transformers`` would otherwise slice the tokens over tp and the experts' gradients would be
  partial over tp). The routed work is so repeated on the tp ranks, and each expert's gradient is whole on every tp
  rank.
- **with context parallelism** a rank's chunk of every sequence is routed like any other tokens; the ep and ``edp``
  groups span dp and cp (an ep group may be a replica's cp ranks), and the gradient divisors below are ``dp x cp``.

Gradients (the native rule, ``distributed/expert_parallel.py``): an expert's gradient already sums the tokens of every
``ep`` rank (the all-to-all backward); it is summed over ``edp`` (the ranks holding the same experts) and divided by
``dp x cp`` (the ranks the dense gradients are averaged over) - by hooks at ZeRO 0/1
(``training/dtensor_data_parallel.py``; ZeRO-1 keeps an expert's optimizer state on one rank of its edp group and
broadcasts its step over edp), by FSDP2 units over the same mesh's ``edp`` dimension at ZeRO 2/3 (the protocol's
``expert_units`` / ``expert_data_parallel_mesh``), whose mean over edp the units' gradients are scaled for
(:class:`GradientScale`: ``edp / (dp x cp)``). The routers, the shared experts and everything else are dense. The
load-balancing loss (``output_router_logits``) is each replica's own, as with data parallelism alone (the router
sees the replica's whole batch at every tp rank, under sequence parallelism too). Refused with the reason
(``support.refusals``): a type with no ``base_model_ep_plan``. Collectives: building the mesh (every rank); per MoE
layer and forward two all-to-alls of the routed tokens and one of their counts (backward: the mirror).
"""
from __future__ import annotations

from torch import nn

from .install_state import update_generic_install


def expert_mesh(context):
    """The ``(one, pp, edp, ep, tp)`` DeviceMesh of the model's ranks, ``edp x ep = dp x cp`` (collective: every
    rank builds it; ``one`` has size 1)."""
    from torch.distributed.device_mesh import init_device_mesh

    replicas = context.dp_size * context.cp_size
    sizes = (1, context.pp_size, replicas // context.ep_size, context.ep_size, context.tp_size)
    return init_device_mesh(context.device.type, sizes, mesh_dim_names=("one", "pp", "edp", "ep", "tp"))


def expert_plan(model: nn.Module, context) -> dict[str, str]:
    """The resolved ``base_model_ep_plan`` (``*`` replaced by layer numbers); empty at ``ep == 1``."""
    if context.ep_size == 1:
        return {}
    from transformers.distributed.configuration_utils import DistributedConfig

    replicas = context.dp_size * context.cp_size
    _, plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=context.ep_size, fsdp_size=replicas,
                                                                 tp_size=1))
    return plan


def without_experts(tp_plan: dict[str, str], ep_plan: dict[str, str]) -> dict[str, str]:
    """``tp_plan`` less the entries of modules the ep plan splits, and of their children (``transformers``' rule)."""
    return {name: style for name, style in tp_plan.items()
            if not any(name == key or name.startswith(key + ".") for key in ep_plan)}


def apply(model: nn.Module, context) -> dict[str, str]:
    """Split the experts of ``model`` (meta or materialized) over ``ep`` by its ``base_model_ep_plan``; returns the
    resolved plan and keeps the mesh in the model's ``GenericInstall`` (``expert_mesh``)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = expert_plan(model, context)
    if not plan:
        raise NotImplementedError(f"expert_parallel_size={context.ep_size}: transformers gives "
                                  f"{type(model).__name__} no expert-parallel plan (base_model_ep_plan)")
    mesh = expert_mesh(context)
    # "one": no rank shares this rank's batch for the dispatch, so tp ranks route their (same) tokens each
    apply_expert_parallelism(model, mesh["ep"], mesh["one"], plan)
    update_generic_install(model, expert_mesh=mesh)
    return plan


def is_expert(param) -> bool:
    """A parameter split over the ``ep`` dimension (a DTensor whose mesh names it)."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())


class GradientScale:
    """A forward pre-hook scaling the gradient of each parameter of its module by ``scale`` (a tensor hook on the
    parameter objects the module holds when it runs: FSDP2's unsharded copies, each hooked once). For an expert
    FSDP2 unit, ``edp / (dp x cp)``: FSDP2 averages over edp, the experts' gradient must be the sum over edp over
    ``dp x cp`` (the native experts scale their gradient in their own forward; FSDP2's
    ``set_gradient_divide_factor`` needs a PREMUL_SUM reduction gloo does not have)."""

    def __init__(self, scale: float):
        self.scale = scale
        self.hooked: dict[str, object] = {}

    def __call__(self, module, args):
        import torch

        if not torch.is_grad_enabled():
            return
        for name, param in module._parameters.items():
            if param is not None and param.requires_grad and self.hooked.get(name) is not param:
                param.register_hook(lambda grad: grad * self.scale)
                self.hooked[name] = param


def expert_units(model: nn.Module) -> list[nn.Module]:
    """The modules that hold expert parameters directly (each its own FSDP2 unit over ``edp``)."""
    return [module for module in model.modules()
            if any(is_expert(param) for param in module.parameters(recurse=False))]
