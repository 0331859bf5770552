"""gpt-oss checkpoints with MXFP4-quantized experts, dequantized on load by ``transformers``' own helper.

The Hub's gpt-oss checkpoints store each stacked expert projection ``P`` (``gate_up_proj``, ``down_proj``) as
``P_blocks [E, rows, G, 16]`` (uint8: two 4-bit E2M1 values per byte, 32 per block) and ``P_scales [E, rows, G]``
(uint8 exponents, bias 127), with ``quantization_config.quant_method == "mxfp4"`` in ``config.json``.
``Mxfp4Reader`` is a ``CheckpointReader`` view showing each pair as the dense ``P`` (``[E, G*32, rows]``: the
model's ``[E, h, 2i]`` / ``[E, i, h]``), computed by ``transformers.integrations.mxfp4.convert_moe_packed_tensors``
(called, not copied) from only the experts read: under expert parallelism a rank dequantizes only its ``E/ep``
experts. The biases and every other tensor pass through. Values come out in fp32 and are cast to the load dtype by
the loader; the model holds (and saves) plain dense weights, so its config loses ``quantization_config``.
"""
from __future__ import annotations

import torch

SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(config) -> bool:
    quantization = getattr(config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", None)
    return str(method).lower() == "mxfp4"


class Mxfp4Reader:
    """``reader`` with every ``P_blocks`` / ``P_scales`` pair seen as the dense ``P`` (see the module docstring)."""

    def __init__(self, reader):
        self.reader = reader
        keys = list(reader.keys())
        self._packed = {key[:-len("_blocks")]: (key, key[:-len("_blocks")] + "_scales")
                        for key in keys if key.endswith("_blocks") and key[:-len("_blocks")] + "_scales" in keys}
        used = {part for pair in self._packed.values() for part in pair}
        self._plain = [key for key in keys if key not in used]

    @classmethod
    def wrap(cls, reader):
        view = cls(reader)
        return view if view._packed else reader

    def keys(self):
        return [*self._plain, *self._packed]

    def __contains__(self, key: str) -> bool:
        return key in self._packed or key in self._plain

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._packed:
            return self.reader.shape(key)
        experts, rows, groups, width = self.reader.shape(self._packed[key][0])
        return (experts, groups * width * 2, rows)

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        if key not in self._packed:
            return self.reader.read(key, index)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        index = index or (slice(None),)
        experts = index[0] if isinstance(index[0], slice) else slice(index[0], index[0] + 1)
        blocks, scales = (self.reader.read(part, (experts,)) for part in self._packed[key])
        dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [e, G*32, rows]
        dense = dense[(slice(None), *index[1:])]
        return dense if isinstance(index[0], slice) else dense[0]
