"""One check of a whole layout against a model class, before any process group: every refusal the project has.

``check_layout`` runs, in order, the same functions the code paths run when they build and wrap a model, so the
answer here is the answer there (and the composition table, ``table.py``, is generated from it):

- ``ParallelConfig`` itself (sizes, modes, axes not implemented together) and the world's size;
- the family's divisibility rules (``validate_parallel_config``: heads, key/value heads, features; features the
  family refuses under an axis, e.g. MoE under sequence parallelism);
- context parallelism's class check (``check_context_parallel``);
- the pipeline's class check (``check_pipeline_support``);
- the training wrappers' rules (``training.layout_rules.check_training_layout``: ZeRO, offload, mixed precision,
  a whole-model ``torch.compile`` under a pipeline).
"""
from __future__ import annotations

from ..models.common.stack.context_parallel import check_context_parallel
from ..pipeline.adapter import check_pipeline_support
from ..training.layout_rules import check_training_layout
from .axes import Layout


def check_model_layout(model_class: type, config, parallel) -> None:
    """The model-dependent part: ``parallel`` (a ``ParallelConfig``) on ``model_class`` built from ``config``."""
    model_class.validate_parallel_config(config, parallel)
    check_context_parallel(model_class, config, parallel)
    check_pipeline_support(model_class, parallel)


def check_layout(layout: Layout, model_class: type, config) -> None:
    """Raise the first ``ValueError`` / ``NotImplementedError`` any part of the project raises for ``layout`` on
    ``model_class`` built from ``config``; return quietly when the layout is accepted."""
    parallel = layout.parallel_config()
    parallel.resolve_data_parallel_size(layout.world_size)
    check_model_layout(model_class, config, parallel)
    check_training_layout(parallel, cpu_offload=layout.cpu_offload, mixed_precision=layout.mixed_precision,
                          compiled=layout.compile)


def refusal(layout: Layout, model_class: type, config) -> str | None:
    """The reason ``check_layout`` gives for refusing ``layout`` (``None``: accepted)."""
    try:
        check_layout(layout, model_class, config)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None
