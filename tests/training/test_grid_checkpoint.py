"""Resumable training checkpoints under the grid tensor-parallel modes (2D, 2.5D, 3D), alone, x pipeline and x
ZeRO. Each weight block of a grid is a box of the same canonical tensor the 1D layouts store (packed q|k|v as
``[3, block]``, the vocabulary without its padding rows), so:

- single process, every grid layer's parameters at every grid rank: the piece a rank holds is exactly the box DCP
  files it under (2D, 2.5D, 3D);
- at the same layout, a run saved at step 2 and resumed in fresh model and optimizer objects trains steps 3 and 4
  bit for bit like the uninterrupted run, dropout on (each rank's RNG, the tensor-parallel tracker's included, is
  restored): 2D tp 4 (4 ranks); 2D tp 4 x pp 2, 3D tp 8, 2D tp 4 x dp 2 at ZeRO-1 and ZeRO-3 (8 ranks);
- at another layout the checkpoint holds the same model: a 2D save loaded at 1D and a 1D save at 2D, 3D at 2.5D,
  2D x pp 2 at 1D x pp 2, 2D x dp 2 ZeRO-1 at 1D x dp 2 equal the saved model's ``full_state_dict`` exactly, and
  one AdamW step (dropout off) after the load equals the step taken at the saving layout (so the Adam moments and
  step counts moved too).

GPT-2 with a vocabulary of 101 (padded on every grid axis), packed q|k|v, biases and norms split over one grid
axis; Llama with grouped-query attention and an untied head for 2D x pp. A box in the wrong place is caught by the
cross-layout loads (a round trip at one layout reads back whatever it wrote): a 3D mesh laid out in grid order
instead of the layout's axis order fails 3D -> 2.5D; a packed view that does not move the other dim fails the box
test. The example script's own run (2D x pp 2, killed after step 4, restarted by torchrun, losses of steps 3 and 4
bit for bit) is in ``tests/faults/test_elastic.py``.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models.training import load_checkpoint, save_checkpoint, shard_data_parallel
from tests.helpers import decoders
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import save_tiny_gpt2, tp_local

VOCAB = 101
DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # so that a resume must restore every RNG
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-5)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return save_tiny_gpt2(tmp_path_factory.mktemp("grid_ckpt") / "gpt2", n_head=8, **DROPOUT)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return decoders.save_tiny(tmp_path_factory.mktemp("grid_ckpt") / "llama", "llama", attention_dropout=0.1)


def _cfg(tp: int, mode: str = "1d", pp: int = 1, depth: int = 1, zero: int = 0) -> om.ParallelConfig:
    extra = dict(pipeline_parallel_size=pp, num_microbatches=2) if pp > 1 else {}
    return om.ParallelConfig(tensor_parallel_size=tp, tensor_parallel_mode=mode, tensor_parallel_depth=depth,
                             zero_stage=zero, **extra)


def _build(path: str, cfg: om.ParallelConfig):
    """Model and AdamW at ``cfg``; with dp > 1 wrapped for ``cfg.zero_stage`` (``shard_data_parallel``)."""
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    if model.parallel_context.dp_size == 1:
        return model, optimizer
    return shard_data_parallel(model, optimizer, zero_stage=cfg.zero_stage)


def _inner(model):
    return getattr(model, "module", model)


def _batch(step: int) -> torch.Tensor:
    """Global batch ``step`` (4 sequences of 8 tokens)."""
    return torch.randint(1, VOCAB, (4, 8), generator=torch.Generator().manual_seed(100 + step))


def _steps(model, optimizer, steps, *, train: bool = True) -> list[float]:
    """AdamW steps on the batches ``steps`` (dropout on with ``train``); the losses."""
    model.train(train)
    losses, context = [], _inner(model).parallel_context
    for step in steps:
        ids = _batch(step).chunk(context.dp_size)[context.dp_rank]  # the grid splits its replica's rows itself
        if context.pp_size > 1:
            loss = model.train_step({"input_ids": ids, "labels": ids})
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.item())
    model.train()
    return losses


def _local(model) -> dict[str, torch.Tensor]:
    """This rank's tensor-parallel pieces (FSDP2's dp shards gathered)."""
    return {name: tp_local(param.detach()).clone() for name, param in model.named_parameters()}


def _assert_same_model(model, expected: dict | None, what: str, *, exact: bool) -> None:
    """``model``'s full state dict (gathered from its layout's pieces, not through the checkpoint) equals
    ``expected`` on rank 0."""
    full = _inner(model).full_state_dict()
    if dist.get_rank() != 0:
        return
    assert full.keys() == expected.keys(), (what, sorted(full.keys() ^ expected.keys()))
    for key, value in expected.items():
        tol = dict(atol=0.0, rtol=0.0) if exact else dict(atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(full[key], value, **tol, msg=lambda m, k=key: f"{what}: {k}: {m}")


def check_resume(path: str, folder: str, cfg: om.ParallelConfig) -> tuple[dict | None, dict | None]:
    """Save at step 2 of 4 and resume at ``cfg``: steps 3 and 4 bit for bit. Returns ``(full state dict at the
    save, after one more dropout-free step from the save)`` on rank 0, for the cross-layout checks (``None``s under
    ZeRO-2/3, whose models ``full_state_dict`` does not gather)."""
    gathers = cfg.zero_stage < 2
    model, optimizer = _build(path, cfg)
    _steps(model, optimizer, range(2))
    save_checkpoint(folder, model, optimizer, step=2)
    saved = _inner(model).full_state_dict() if gathers else None
    uninterrupted = _steps(model, optimizer, range(2, 4))
    expected = _local(model)
    breadcrumb(f"{cfg.tensor_parallel_mode} uninterrupted")

    resumed, resumed_optimizer = _build(path, cfg)
    info = load_checkpoint(folder, resumed, resumed_optimizer)
    assert info["step"] == 2 and info["same_layout"], info
    assert _steps(resumed, resumed_optimizer, range(2, 4)) == uninterrupted  # bit for bit, dropout on
    for name, param in _local(resumed).items():
        assert torch.equal(param, expected[name]), name
    if not gathers:
        return None, None
    stepped, stepped_optimizer = _build(path, cfg)  # one dropout-free step from the save, at the saving layout
    load_checkpoint(folder, stepped, stepped_optimizer)
    _steps(stepped, stepped_optimizer, [2], train=False)
    return saved, _inner(stepped).full_state_dict()


def check_other_layout(path: str, folder: str, cfg: om.ParallelConfig, saved, stepped, what: str):
    """The checkpoint in ``folder`` loaded at ``cfg`` (another layout) is the saved model, and one dropout-free
    step from it equals the step at the saving layout."""
    model, optimizer = _build(path, cfg)
    info = load_checkpoint(folder, model, optimizer)
    assert not info["same_layout"], info
    _assert_same_model(model, saved, f"{what} loaded", exact=True)
    _steps(model, optimizer, [2], train=False)
    _assert_same_model(model, stepped, f"{what} stepped", exact=False)


def _worker_2d(path: str, root: str) -> None:
    torch.manual_seed(0)  # the same default stream on every rank, as a launched job seeds it (dropout outside splits)
    grid = _cfg(4, "2d")
    saved, stepped = check_resume(path, os.path.join(root, "2d"), grid)
    check_other_layout(path, os.path.join(root, "2d"), _cfg(4), saved, stepped, "2d -> 1d")
    # and back: a 1D tp 4 save loaded at 2D
    model, optimizer = _build(path, _cfg(4))
    _steps(model, optimizer, range(2))
    save_checkpoint(os.path.join(root, "1d"), model, optimizer, step=2)
    saved = model.full_state_dict()
    _steps(model, optimizer, [2], train=False)
    check_other_layout(path, os.path.join(root, "1d"), grid, saved, model.full_state_dict(), "1d -> 2d")


def test_2d_checkpoint_resumes_and_loads_at_1d(gpt2, tmp_path):
    run_distributed(_worker_2d, 4, gpt2, str(tmp_path), timeout=300)


def _worker_8(gpt2: str, llama: str, root: str) -> None:
    torch.manual_seed(0)
    folder = os.path.join(root, "2d_pp2")
    saved, stepped = check_resume(llama, folder, _cfg(4, "2d", pp=2))
    check_other_layout(llama, folder, _cfg(4, pp=2), saved, stepped, "2d x pp2 -> 1d x pp2")
    folder = os.path.join(root, "3d")
    saved, stepped = check_resume(gpt2, folder, _cfg(8, "3d"))
    check_other_layout(gpt2, folder, _cfg(8, "2.5d", depth=2), saved, stepped, "3d -> 2.5d")
    # 2D x dp 2: ZeRO-1 (each optimizer state written by its dp owner, read by the new one), ZeRO-3 (FSDP2 shards)
    folder = os.path.join(root, "2d_dp2_zero1")
    saved, stepped = check_resume(gpt2, folder, _cfg(4, "2d", zero=1))
    check_other_layout(gpt2, folder, _cfg(4), saved, stepped, "2d x dp2 ZeRO-1 -> 1d x dp2")
    check_resume(gpt2, os.path.join(root, "2d_dp2_zero3"), _cfg(4, "2d", zero=3))


def test_grid_x_pipeline_3d_and_zero_checkpoints(gpt2, llama, tmp_path):
    run_distributed(_worker_8, 8, gpt2, llama, str(tmp_path), timeout=600)


def _grid_context(cfg: om.ParallelConfig, rank: int):
    """Tensor-parallel rank ``rank`` of ``cfg``'s grid (pp = dp = 1) as a ``ParallelContext`` without process
    groups: enough for layouts, which read only each axis' size, rank and ranks."""
    from oslo_models.distributed.context import EXPERT_AXES, MESH_AXES, TP_SUB_AXES, AxisInfo, ParallelContext

    size, names, shape = cfg.tensor_parallel_size, TP_SUB_AXES[cfg.tensor_parallel_mode], cfg.grid_shape
    grid = torch.arange(size).reshape(shape)
    coords = [int(c) for c in torch.nonzero(grid == rank)[0]]
    axes = {name: AxisInfo(None, 1, 0, (rank,)) for name in MESH_AXES + EXPERT_AXES + ("dp_cp",)}
    axes["tp"] = AxisInfo(None, size, rank, tuple(range(size)))
    for i, name in enumerate(names):
        line = [slice(None) if j == i else c for j, c in enumerate(coords)]
        axes[name] = AxisInfo(None, shape[i], coords[i], tuple(int(r) for r in grid[tuple(line)]))
    return ParallelContext(cfg, world_size=size, rank=rank, device=torch.device("cpu"), axes=axes)


def _grid_layouts(context) -> dict:
    """``{name: (layout, full shape)}`` of the grid layers' parameters, the layouts from the layers themselves
    (built on the meta device)."""
    from oslo_models.parallel_layers import tensor_parallel_2d as two
    from oslo_models.parallel_layers import tensor_parallel_3d as three
    from oslo_models.parallel_layers.summa import Grid

    grid, meta = Grid.from_context(context), dict(device="meta")
    if context.tensor_parallel_mode == "3d":
        layers = {"c_attn": three.Linear3D(8, 24, cube=grid, column=True, layout="conv1d", num_packed=3, **meta),
                  "gate_up": three.Linear3D(8, 16, cube=grid, column=True, **meta),  # 3D packs only Conv1D
                  "down": three.Linear3D(16, 8, cube=grid, column=False, **meta),
                  "head": three.Linear3D(8, 13, cube=grid, column=True, vocab_size=13, **meta),
                  "wte": three.VocabEmbedding3D(13, 8, cube=grid, **meta)}
    else:
        layers = {"c_attn": two.Linear2D(8, 24, grid=grid, layout="conv1d", num_packed=3, **meta),
                  "gate_up": two.Linear2D(8, 16, grid=grid, num_packed=2, **meta),
                  "head": two.Linear2D(8, 13, grid=grid, vocab_size=13, **meta),
                  "wte": two.VocabEmbedding2D(13, 8, grid=grid, **meta),
                  "wpe": two.HiddenEmbedding2D(5, 8, grid=grid, **meta)}
    shapes = {"c_attn.weight": (8, 24), "c_attn.bias": (24,), "gate_up.weight": (16, 8), "gate_up.bias": (16,),
              "down.weight": (8, 16), "down.bias": (8,), "head.weight": (13, 8), "head.bias": (13,),
              "wte.weight": (13, 8), "wpe.weight": (5, 8)}
    return {f"{layer}.{name}": (spec, shapes[f"{layer}.{name}"]) for layer, module in layers.items()
            for name, spec in module.tp_shard_specs().items()}


@pytest.mark.parametrize("mode,size,depth", [("2d", 4, 1), ("2.5d", 8, 2), ("3d", 8, 1)])
def test_every_grid_block_is_a_box_of_the_canonical_tensor(mode, size, depth):
    """Single process: for each grid layer's parameters (packed q|k|v in conv1d layout, packed gate|up in linear
    layout, a vocabulary of 13 padded on every axis, row- and column-parallel 3D blocks) and every grid rank, the
    piece the rank holds (``read_local``: the loader's own slicing) is exactly the box DCP files it under - the
    chunk of ``_to_dcp``'s DTensor - of the canonical tensor the layout stores at one rank, which is the 1D
    layouts' (``[3, block]`` for packed blocks); and together the boxes cover the tensor evenly."""
    from oslo_models.training.checkpoint import _to_dcp

    cfg = _cfg(size, mode, depth=depth)
    one = om.ParallelContext.single_process(cfg)
    contexts = [_grid_context(cfg, rank) for rank in range(size)]
    layouts = _grid_layouts(contexts[0])
    assert len(layouts) >= 8
    for name, (spec, shape) in layouts.items():
        full = torch.randn(shape)
        canonical, canonical_shape, shards = spec.dcp_view(full, one)
        assert shards == () and tuple(canonical.shape) == canonical_shape, name
        if name == "c_attn.weight" or (name == "gate_up.weight" and mode != "3d"):
            assert canonical.dim() == 3, (name, canonical_shape)  # the packed view, as 1D stores it
        covered = torch.zeros(canonical_shape)
        for context in contexts:
            local = spec.read_local(shape, full.__getitem__, context)
            box, global_shape, shards = spec.dcp_view(local, context)
            assert global_shape == canonical_shape, (name, global_shape, canonical_shape)
            (chunk,) = _to_dcp(box, global_shape, shards, context).__create_chunk_list__()
            where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
            torch.testing.assert_close(box, canonical[where], atol=0, rtol=0, msg=f"{name} rank {context.rank}")
            covered[where] += 1
        # each element is filed by the same number of ranks (its replicas over unused grid axes): none left out
        assert covered.min() > 0 and (covered == covered.flatten()[0]).all(), name
