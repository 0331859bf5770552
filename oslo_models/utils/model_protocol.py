"""The questions ``training/``, ``pipeline/`` and the planner ask a model, answered the same way by every model.

``protocol_of(model)`` returns the model's :class:`ModelProtocol` (its ``oslo_protocol``: a class attribute of the
native families, set on the instance by the generic path's loader; a model without one answers as a native model).
The callers ask the protocol and never which kind of model they hold:

- ``fsdp_units(model)``: the submodules that become their own FSDP2 unit (ZeRO-2/3, per-block plans, the planner);
- ``layout``: where a parameter states its split - ``"plan"`` (the model's ``parallel_plan`` layouts: plain
  local tensors whose split the plan describes) or ``"placements"`` (the parameters are DTensors whose placements
  describe it). Clipping and the training checkpoint read each the one source (``training/clip*.py``);
- ``pipeline_adapter(model)``: the ``pipeline.PipelineAdapter`` that cuts it into stages;
- ``block_plan_refusal``: why a per-block ZeRO plan (``ParallelConfig.block_plan``) cannot apply, or ``None``;
- ``expert_units(model)`` / ``expert_data_parallel_mesh(model, context)`` / ``divide_expert_gradients``: under
  expert parallelism, the modules holding experts (their own FSDP2 units), the mesh of the ranks holding the same
  experts they shard over, and how a unit's gradient becomes the sum over that mesh divided by dp.

Data parallelism needs no answer: torch DDP cannot hold DTensor parameters, so a model with any goes through
``training/dtensor_data_parallel.py`` whatever its kind. No collective here.
"""
from __future__ import annotations

from torch import nn

from .modules import shares_parameters_outside, unwrap_model


class ModelProtocol:
    """The native answers (``oslo_models`` families); the generic path overrides them (``generic/protocol.py``)."""

    layout = "plan"
    block_plan_refusal: str | None = None

    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks (``_no_split_modules``) that share no parameter with a module outside them. A block
        holding a tied weight (BERT/RoBERTa embeddings, tied to the MLM decoder in the root) stays in the root unit
        with the other copy."""
        block_types = set(getattr(model, "_no_split_modules", None) or ())
        return [module for prefix, module in model.named_modules()
                if module is not model and type(module).__name__ in block_types
                and not shares_parameters_outside(prefix, module, model)]

    def check_layout(self, model: nn.Module, parallel) -> None:
        """Raise (before any collective) if ``model`` cannot run at the ``ParallelConfig`` ``parallel`` (e.g. another
        ZeRO stage than it was built for): the family's ``validate_parallel_config``."""
        type(model).validate_parallel_config(model.config, parallel)

    def training_refusal(self, model: nn.Module) -> str | None:
        """Why ``model`` as it stands (with what was added to it after loading, e.g. ``peft`` adapters) cannot be
        trained at its layout, or ``None``. Read by ``training.shard_data_parallel`` before any collective."""
        return None

    def pipeline_sharding_refusal(self, model: nn.Module) -> str | None:
        """Why ZeRO-2/3 (FSDP2 over each stage) cannot wrap this pipelined ``model``, or ``None`` when it can."""
        return None

    def pipeline_adapter(self, model: nn.Module):
        """The ``pipeline.PipelineAdapter`` that cuts ``model`` into stages (its class's ``pipeline_adapter``);
        ``NotImplementedError`` naming the class when it has none."""
        from ..pipeline.adapter import _adapter_class

        return _adapter_class(type(model))()

    def expert_units(self, model: nn.Module) -> list[nn.Module]:
        """The modules holding stacked experts split over the expert-parallel group (layout axis ``"ep"``)."""
        from ..distributed.expert_parallel import expert_parameter_names

        owners = {name.rpartition(".")[0] for name in expert_parameter_names(model)}
        return [model.get_submodule(name) for name in sorted(owners)]

    def divide_expert_gradients(self, unit: nn.Module, expert_data_parallel_size: int, dp_size: int) -> None:
        """Make an expert FSDP2 unit's gradient the sum over edp divided by dp (FSDP2 averages over edp): the
        native experts scale their gradient by ``edp / dp`` in their forward (``gradient_scale``)."""
        unit.gradient_scale = expert_data_parallel_size / dp_size

    def expert_data_parallel_mesh(self, model: nn.Module, context):
        """A one-axis DeviceMesh over this rank's expert-data-parallel group (collective: every rank builds the
        whole ``(pp, edp, ep, tp)`` mesh, in which ``ep`` is the inner part of ``dp``, as ``ParallelContext`` carves
        it)."""
        from torch.distributed.device_mesh import init_device_mesh

        # ep is the inner part of dp x cp (cp ranks hold the same weights; the flattened index is d * cp + c)
        sizes = (context.pp_size, context.dp_cp_size // context.ep_size, context.ep_size, context.tp_size)
        mesh = init_device_mesh(context.device.type, sizes, mesh_dim_names=("pp", "edp", "ep", "tp"))
        return mesh["edp"]


_NATIVE = ModelProtocol()


def protocol_of(model: nn.Module) -> ModelProtocol:
    """The protocol of ``model`` (possibly inside DDP)."""
    return getattr(unwrap_model(model), "oslo_protocol", None) or _NATIVE
