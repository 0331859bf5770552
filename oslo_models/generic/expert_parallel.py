"""Expert parallelism for ``transformers``' MoE blocks on the generic path: their own expert-parallel plan.

``transformers`` 5.x gives most MoE types a ``base_model_ep_plan``: the fused experts' weights ``grouped_gemm``
(``Shard(0)`` over the experts: whole experts per rank) and the experts module ``ep_dispatch_experts``, whose
all-to-all implementation sends each (token, expert) pair to the rank holding the expert and the results back, with
autograd all-to-alls (``transformers.distributed.expert_parallel``). The generic path applies that plan (on the meta
model, before ``transformers``' loader reads each rank's experts) over the ``ep`` dimension of a
``(pp, edp, ep, tp)`` DeviceMesh of the model's ranks: ``ep`` is carved out of ``dp`` as for the native families, so
every rank keeps its own batch and the experts of one ``ep`` group are split over it.

Gradients (the native rule, ``distributed/expert_parallel.py``): an expert's gradient already sums the tokens of every
``ep`` rank (the all-to-all backward); it is summed over ``edp`` (the ranks holding the same experts) and divided by
``dp`` - by hooks at ZeRO 0 (``training/dtensor_data_parallel.py``), by FSDP2 units over the same mesh's ``edp``
dimension at ZeRO 2/3 (the protocol's ``expert_units`` / ``expert_data_parallel_mesh``), whose mean over edp the
units' gradients are scaled for (:class:`GradientScale`: ``edp / dp``). The routers, the shared
experts and everything else are dense. The load-balancing loss (``output_router_logits``) is each replica's own, as
with data parallelism alone. Refused with the reason (``support.refusals``): a type with no ``base_model_ep_plan``,
ep with tp or cp, and ZeRO-1 (its optimizer-state owners broadcast over dp, which would overwrite other ranks'
experts). Collectives: building the mesh (every rank); per MoE layer and forward two all-to-alls of the routed tokens
and one of their counts (backward: the mirror).
"""
from __future__ import annotations

from torch import nn


def expert_mesh(context):
    """The ``(pp, edp, ep, tp)`` DeviceMesh of the model's ranks (collective: every rank builds it)."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (context.pp_size, context.dp_size // context.ep_size, context.ep_size, context.tp_size)
    return init_device_mesh(context.device.type, sizes, mesh_dim_names=("pp", "edp", "ep", "tp"))


def apply(model: nn.Module, context) -> dict[str, str]:
    """Split the experts of ``model`` (meta or materialized) over ``ep`` by its ``base_model_ep_plan``; returns the
    resolved plan and keeps the mesh as ``model._oslo_expert_mesh``."""
    from transformers.distributed.configuration_utils import DistributedConfig
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    _, plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=context.ep_size, fsdp_size=context.dp_size,
                                                                 tp_size=context.tp_size))
    if not plan:
        raise NotImplementedError(f"expert_parallel_size={context.ep_size}: transformers gives "
                                  f"{type(model).__name__} no expert-parallel plan (base_model_ep_plan)")
    mesh = expert_mesh(context)
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)
    model._oslo_expert_mesh = mesh
    return plan


def is_expert(param) -> bool:
    """A parameter split over the ``ep`` dimension (a DTensor whose mesh names it)."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())


class GradientScale:
    """A forward pre-hook scaling the gradient of each parameter of its module by ``scale`` (a tensor hook on the
    parameter objects the module holds when it runs: FSDP2's unsharded copies, each hooked once). For an expert
    FSDP2 unit, ``edp / dp``: FSDP2 averages over edp, the experts' gradient must be the sum over edp over dp (the
    native experts scale their gradient in their own forward; FSDP2's ``set_gradient_divide_factor`` needs a
    PREMUL_SUM reduction gloo does not have)."""

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
