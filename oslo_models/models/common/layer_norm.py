"""``LayerNorm`` as a block component: the plain layer (``parallel_layers.layers.LayerNorm``) with its plan fragment,
a sequence-parallel-aware norm (replicated weight and bias, gradients summed over TP when each rank normalized
only its slice of the tokens)."""
from __future__ import annotations

from ...parallel_layers import layers
from ...parallel_layers.plan import SequenceParallelNorm


class LayerNorm(layers.LayerNorm):
    tp_plan = {"": SequenceParallelNorm()}
