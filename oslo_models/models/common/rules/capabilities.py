"""What a model class runs beyond what every class runs: one frozen record per class, read by the validation.

A class declares only what it adds or changes (``capabilities = Capabilities(context_parallel=True)``); the
record that counts, :func:`capabilities_of`, merges the declarations along the method resolution order: each
field from the first class that sets it (``None`` leaves it to the classes after), ``False`` where none does. So a
head class and its family's ``PreTrainedModel`` each say their part (``MixtralForCausalLM``: context parallelism
from ``ForCausalLM``, the MoE fields from ``MixtralPreTrainedModel``), and a family refines one field
(``DeepseekV3PreTrainedModel``: ``moe_grid=False``) without restating the others.

Readers: ``common/stack/context_parallel.check_context_parallel`` (context parallelism, also for the generic path's
``om.capabilities`` and ``composition/check.py``, which call it) and the MoE families' ``validate_parallel_config``.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capabilities:
    #: runs under context parallelism (the base models and LM heads of GPT-2, BERT and the stack decoders, T5's and
    #: BART's base models and conditional-generation heads, the stack decoders' classification heads; not the heads
    #: that pool one token of an encoder)
    context_parallel: bool | None = None
    #: its MoE router loss sums its statistics over the context-parallel ranks (needed for cp with experts)
    moe_context_parallel: bool | None = None
    #: its MoE block runs sequence-parallel and under pipeline x tensor / expert parallelism (``SparseMoeBlock``)
    moe_sequence_parallel: bool | None = None
    #: its MoE block runs on the 2D / 2.5D grid (the grid-planned ``TopKRouter``)
    moe_grid: bool | None = None


_FIELDS = tuple(field.name for field in dataclasses.fields(Capabilities))


def capabilities_of(model_class: type) -> Capabilities:
    """The class's record: each field from the first class of its MRO whose own ``capabilities`` sets it, else
    ``False``."""
    values: dict[str, bool] = {}
    for klass in model_class.__mro__:
        own = klass.__dict__.get("capabilities")
        if isinstance(own, Capabilities):
            for name in _FIELDS:
                if name not in values and getattr(own, name) is not None:
                    values[name] = getattr(own, name)
    return Capabilities(**{name: values.get(name, False) for name in _FIELDS})
