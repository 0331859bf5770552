"""The distributed saver's pieces, single process: every layout's boxes invert its ``read_shard`` exactly (each
rank's boxes are its piece, all ranks' boxes tile the full tensor once), flat runs of a box, the file plan and
headers byte for byte what ``safetensors`` / ``huggingface_hub`` write, and the expert key map equal to
``to_per_expert``. Negative controls: a box map of another rank, a broken run map."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oslo_models.conversion.boxes import clip_rows, flat_runs, grid_of, layout_boxes, split_box
from oslo_models.conversion.hub_keys import Region, _per_expert
from oslo_models.conversion.safetensors_files import HubTensor, as_bytes, create_files, dtype_name, plan_files
from oslo_models.parallel_layers.grouped_qkv import GroupedQKVSplit
from oslo_models.parallel_layers.moe.experts import ExpertTensorSplit
from oslo_models.parallel_layers.sharding import (
    REPLICATED,
    EvenSplit,
    GridBlock,
    HeadSplit,
    InterleavedSplit,
    PackedSplit,
    VocabSplit,
)

CASES = [  # (layout, full shape, sizes)
    (REPLICATED, (6, 4), [1, 2]),
    (EvenSplit(0), (8, 3), [1, 2, 4]),
    (EvenSplit(1), (3, 8), [2, 4]),
    (InterleavedSplit(1, period=2), (2, 12), [2, 3]),
    (VocabSplit(0, 13), (13, 4), [2, 4]),
    (VocabSplit(1, 11), (3, 11), [2, 3]),
    (HeadSplit(0, 2), (8, 3), [2, 4]),  # at 4: each head on 2 ranks
    (PackedSplit(1, (1, 1, 1)), (3, 12), [2]),
    (PackedSplit(0, (4, 2, 2), heads=True), (16, 5), [2, 4]),  # GQA q|k|v, k/v replicated at 4
    (PackedSplit(0, (4, 1, 1), heads=True), (12, 2), [2, 4]),
    (GroupedQKVSplit(0, 2, (2, 1, 1)), (16, 3), [2, 4]),
    (GridBlock(EvenSplit(0, "tp_row"), EvenSplit(1, "tp_col")), (4, 6), [(2, 2), (2, 3)]),
    (GridBlock(VocabSplit(0, 7, "tp_row"), EvenSplit(1, "tp_col")), (7, 4), [(2, 2)]),
    (ExpertTensorSplit(EvenSplit(0, "ep"), PackedSplit(1, (1, 1), axis="etp")), (4, 8, 3), [(2, 2), (4, 2)]),
]


def _ranks(size):
    return list(itertools.product(range(size[0]), range(size[1]))) if isinstance(size, tuple) else range(size)


@pytest.mark.parametrize("layout, shape, sizes", CASES, ids=[type(c[0]).__name__ + str(c[1]) for c in CASES])
def test_boxes_invert_read_shard(layout, shape, sizes):
    full = torch.randn(shape)
    for size in sizes:
        count = torch.zeros(shape, dtype=torch.int64)
        every = []
        for rank in _ranks(size):
            local = layout.read_shard(shape, full.__getitem__, rank, size)
            full_shape, boxes = layout_boxes(layout, local.shape, rank, size)
            assert full_shape == shape
            for box in boxes:
                target = tuple(slice(s, s + n) for s, n in zip(box.full_start, box.length))
                torch.testing.assert_close(local[box.local_index()], full[target], rtol=0, atol=0)
                every.append((box.full_start, box.length))
        grid = grid_of(every)
        distinct = {sub[:2] for start, length in every for sub in split_box(start, length, grid)}
        for start, length in distinct:  # replicas of a (cut) box are written once
            count[tuple(slice(s, s + n) for s, n in zip(start, length))] += 1
        assert bool((count == 1).all()), f"size {size}: the boxes do not tile the tensor once"


def test_boxes_of_another_rank_do_not_match():
    """Negative control: rank 1's boxes applied to rank 0's piece (a saver that got the position wrong)."""
    layout, shape = PackedSplit(0, (4, 2, 2), heads=True), (16, 5)
    full = torch.randn(shape)
    local = layout.read_shard(shape, full.__getitem__, 0, 2)
    _, boxes = layout_boxes(layout, local.shape, 1, 2)
    assert any(not torch.equal(local[b.local_index()], full[tuple(slice(s, s + n) for s, n in
                                                                  zip(b.full_start, b.length))]) for b in boxes)


def test_clip_rows_is_the_zero3_shard():
    layout, shape = PackedSplit(0, (1, 1, 1)), (12, 3)
    full = torch.randn(shape)
    local = layout.read_shard(shape, full.__getitem__, 1, 2)  # 6 rows: 2 of q, k, v each
    _, boxes = layout_boxes(layout, local.shape, 1, 2)
    rows = local[1:5]  # a dp shard: rows 1..4 of the tp piece
    for box in clip_rows(boxes, 1, 5):
        target = tuple(slice(s, s + n) for s, n in zip(box.full_start, box.length))
        torch.testing.assert_close(rows[box.local_index()], full[target], rtol=0, atol=0)
    assert sum(b.numel for b in clip_rows(boxes, 1, 5)) == rows.numel()


@pytest.mark.parametrize("shape, start, length", [((5, 7), (1, 2), (3, 4)), ((4, 6), (1, 0), (2, 6)),
                                                  ((2, 3, 4), (0, 1, 1), (2, 2, 3)), ((9,), (3,), (4,)),
                                                  ((2, 3, 4), (1, 0, 0), (1, 3, 4)), ((), (), ())])
def test_flat_runs(shape, start, length):
    full = torch.arange(int(np.prod(shape))).reshape(shape)
    box = full[tuple(slice(s, s + n) for s, n in zip(start, length))].reshape(-1)
    starts, run = flat_runs(shape, start, length)
    got = torch.cat([torch.arange(s, s + run) for s in starts])
    assert torch.equal(got, box)


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.int8]


def test_file_plan_is_what_safetensors_and_the_hub_write(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    torch.manual_seed(0)
    state = {f"layer.{i}.w": torch.randn(3 + i, 5).to(DTYPES[i % len(DTYPES)]) for i in range(9)}
    state["big"] = torch.randn(40, 10)
    state["scalar"] = torch.tensor(3.0)
    tensors = [HubTensor(k, tuple(v.shape), dtype_name(v.dtype)) for k, v in state.items()]
    plan = plan_files(tensors, 300)
    split = split_torch_state_dict_into_shards(state, max_shard_size=300)
    assert {name: sorted(keys) for name, keys in split.filename_to_tensors.items()} == \
        {name: sorted(k for k, (f, _) in plan.where.items() if f == name) for name in plan.files}
    create_files(str(tmp_path), plan)
    for name in plan.files:  # fill the data as the writer would, then compare with save_file's bytes
        with open(tmp_path / name, "r+b") as handle:
            for key, (file_name, offset) in plan.where.items():
                if file_name == name:
                    handle.seek(offset)
                    handle.write(as_bytes(state[key].contiguous()).tobytes())
        save_file({k: state[k] for k in split.filename_to_tensors[name]}, tmp_path / "ref", metadata={"format": "pt"})
        assert (tmp_path / name).read_bytes() == (tmp_path / "ref").read_bytes(), name


def test_expert_regions_equal_to_per_expert():
    from oslo_models.models.common.loading.expert_keys import ExpertKeyLayout, to_per_expert

    for layout in (ExpertKeyLayout(gate="w1", up="w3", down="w2", hub_block="block_sparse_moe"),
                   ExpertKeyLayout(expert_prefix="expert_", stacked=(("wi", ("wi",)), ("wo", ("wo",))))):
        state = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 5),
                 "model.layers.0.mlp.experts.down_proj": torch.randn(3, 5, 4),
                 "model.layers.0.mlp.experts.wi": torch.randn(3, 6, 5), "model.layers.0.mlp.gate.weight":
                 torch.randn(3, 5)}
        expected = to_per_expert(state, layout)
        got = {}
        for key, tensor in state.items():
            for region in _per_expert(Region(key, 0, tuple(tensor.shape)), layout):
                flat = tensor.reshape(-1)
                got[region.key] = flat[region.start: region.start + int(np.prod(region.shape))].view(region.shape)
        assert list(got) == list(expected)
        for key in expected:
            assert torch.equal(got[key], expected[key]), key


def test_write_box_in_small_host_copies(tmp_path):
    """Boxes written through a 40-byte buffer (one row per copy) into two Hub tensors that split the model tensor
    (as per-expert regions do) give the tensor itself; a box given the wrong corner does not."""
    from safetensors.torch import load_file

    from oslo_models.conversion.hub_export import Files, write_box

    full = torch.randn(4, 5, 6)
    regions = [("a", 0, (2, 5, 6)), ("b", 60, (2, 5, 6))]  # experts 0-1 and 2-3
    plan = plan_files([HubTensor("a", (2, 5, 6), "F32"), HubTensor("b", (2, 5, 6), "F32")], "1GB")

    def write(folder, shift):
        create_files(str(folder), plan)
        files = Files(str(folder))
        for s0, s1, s2 in itertools.product((0, 3), (0, 2), (0, 3)):
            n0, n1 = (3 if s0 == 0 else 1), (2 if s1 == 0 else 3)
            view = full[s0:s0 + n0, s1:s1 + n1, s2:s2 + 3]
            write_box(files, plan.where, (4, 5, 6), 4, regions, (s0, s1, (s2 + shift) % 6), (n0, n1, 3), view, 40)
        files.close(sync=True)
        saved = load_file(str(folder / "model.safetensors"))
        return torch.cat([saved["a"], saved["b"]])

    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    assert torch.equal(write(tmp_path / "good", 0), full)
    assert not torch.equal(write(tmp_path / "bad", 3), full)
