"""Per-expert checkpoint keys <-> the stacked experts held in memory.

Hub MoE checkpoints store one tensor per expert and projection (Mixtral: ``block_sparse_moe.experts.N.w1/w3/w2``
= gate/up/down, ``block_sparse_moe.gate``; Qwen2-MoE: ``mlp.experts.N.gate_proj/up_proj/down_proj``), and
``transformers`` 5.x writes that layout on ``save_pretrained`` too, while it holds the experts stacked in memory
(``mlp.experts.gate_up_proj [E, 2i, h]``, ``mlp.experts.down_proj [E, h, i]``; its ``conversion_mapping``).
Switch Transformers: ``mlp.experts.expert_N.wi/wo.weight``, which ``transformers`` (no conversion mapping for it)
both reads and writes, and holds as one module per expert; here they are stacked as ``mlp.experts.wi [E, f, d]``
and ``mlp.experts.wo [E, d, f]`` (``expert_prefix="expert_"``, one part per stacked tensor).
This module is the same two-way mapping for the sliced loader and the saver:

- ``ExpertKeyReader``: a ``CheckpointReader`` view that shows per-expert keys as the stacked ones; reading rows
  ``a:b`` of dim 0 (this rank's experts under expert parallelism) opens only those experts' tensors. A checkpoint
  already in the stacked layout passes through.
- ``to_per_expert``: the gathered stacked state dict -> the per-expert Hub layout, to save;
- ``PerExpertCheckpoint``: the model mixin that applies both (``expert_key_layout`` per family).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_PER_EXPERT = re.compile(r"^(.*)\.experts\.([a-z_]*?)(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class ExpertKeyLayout:
    """A family's per-expert names: ``gate``/``up``/``down`` projections, and ``hub_block`` the name of the MoE block
    in checkpoints when it differs from the module's ``mlp`` (Mixtral: ``block_sparse_moe``).

    ``stacked``: which per-expert projections make each stacked tensor, concatenated along its dim 1 (default:
    ``gate_up_proj`` = gate, up; ``down_proj`` = down); ``expert_prefix``: what precedes the expert number in the
    key (Switch Transformers: ``expert_``)."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    hub_block: str = "mlp"
    expert_prefix: str = ""
    stacked: tuple[tuple[str, tuple[str, ...]], ...] | None = None

    @property
    def parts(self) -> dict[str, tuple[str, ...]]:
        """Stacked tensor name -> the per-expert projection names it holds, in order."""
        if self.stacked is not None:
            return dict(self.stacked)
        return {"gate_up_proj": (self.gate, self.up), "down_proj": (self.down,)}

    def to_module(self, key: str) -> str:
        return _rename(key, self.hub_block, "mlp")

    def to_hub(self, key: str) -> str:
        return _rename(key, "mlp", self.hub_block)


def _rename(key: str, old: str, new: str) -> str:
    """``old`` -> ``new`` as a whole dotted name component of ``key``."""
    return key if old == new else re.sub(rf"(?<=\.){old}(?=\.|$)", new, key)


class ExpertKeyReader:
    """``reader`` seen with per-expert tensors stacked into ``experts.gate_up_proj`` / ``experts.down_proj``."""

    def __init__(self, reader, layout: ExpertKeyLayout):
        self.reader = reader
        self._renamed: dict[str, str] = {}
        self._stacked: dict[str, list[tuple[str, ...]]] = {}
        found: dict[str, dict[str, dict[int, str]]] = {}
        projections = {name for names in layout.parts.values() for name in names}
        for key in reader.keys():
            match = _PER_EXPERT.match(key)
            if match and match.group(2) == layout.expert_prefix and match.group(4) in projections:
                block = layout.to_module(match.group(1))
                found.setdefault(block, {}).setdefault(match.group(4), {})[int(match.group(3))] = key
            else:
                self._renamed[layout.to_module(key)] = key
        for block, parts in found.items():
            experts = range(max(len(found_part) for found_part in parts.values()))
            for stacked, names in layout.parts.items():
                try:
                    self._stacked[f"{block}.experts.{stacked}"] = [tuple(parts[name][e] for name in names)
                                                                   for e in experts]
                except KeyError as missing:
                    raise ValueError(f"checkpoint experts of {block} are incomplete: no tensor for "
                                     f"{missing}") from None

    @classmethod
    def wrap(cls, reader, layout: ExpertKeyLayout):
        """The view, or ``reader`` itself when nothing is per-expert or renamed."""
        view = cls(reader, layout)
        return view if view._stacked or any(k != v for k, v in view._renamed.items()) else reader

    def keys(self):
        return [*self._renamed, *self._stacked]

    def __contains__(self, key: str) -> bool:
        return key in self._renamed or key in self._stacked

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._stacked:
            return self.reader.shape(self._renamed[key])
        parts = self._stacked[key]
        first = self.reader.shape(parts[0][0])
        return (len(parts), first[0] * len(parts[0]), *first[1:])

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        if key not in self._stacked:
            return self.reader.read(self._renamed[key], index)
        parts = self._stacked[key]
        index = index or (slice(None),)
        chosen = parts[index[0]] if isinstance(index[0], slice) else [parts[index[0]]]
        stacked = torch.stack([torch.cat([self.reader.read(name) for name in names]) for names in chosen])
        rest = (slice(None), *index[1:])
        return stacked[rest] if isinstance(index[0], slice) else stacked[rest][0]


def to_per_expert(state_dict: dict[str, torch.Tensor], layout: ExpertKeyLayout) -> dict[str, torch.Tensor]:
    """Stacked experts -> one tensor per expert and projection, keys in the Hub layout (see the module doc)."""
    out, parts = {}, layout.parts
    for key, tensor in state_dict.items():
        block, _, leaf = key.rpartition(".experts.")
        if not block or leaf not in parts:
            out[layout.to_hub(key)] = tensor
            continue
        hub_block, names = layout.to_hub(block), parts[leaf]
        for name, piece in zip(names, tensor.chunk(len(names), dim=1)):
            for e in range(tensor.shape[0]):
                out[f"{hub_block}.experts.{layout.expert_prefix}{e}.{name}.weight"] = piece[e].contiguous()
    return out


class PerExpertCheckpoint:
    """Model mixin: checkpoints are read and written in the per-expert Hub layout of ``expert_key_layout`` (as
    ``transformers`` saves them); stacked-layout checkpoints load too. Put it before the family's base class."""

    expert_key_layout: ExpertKeyLayout = ExpertKeyLayout()

    def load_from_reader(self, reader, *, progress: bool = False, **options):
        return super().load_from_reader(ExpertKeyReader.wrap(reader, self.expert_key_layout), progress=progress,
                                        **options)

    def full_state_dict(self):
        full = super().full_state_dict()
        return None if full is None else to_per_expert(full, self.expert_key_layout)
