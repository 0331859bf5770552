"""``training.save_pretrained`` and ``model.save_pretrained`` write the Hub folder from every rank, nothing gathered
(issue 53).

One world of 4 ranks trains one AdamW step at each layout - tp2 x dp2 ZeRO-3 (GPT-2: packed q|k|v, a vocabulary tp
does not divide), tp2 x dp2 ZeRO-1 (GPT-2), dp4 ZeRO-2 (Llama), pp2 x tp2 (GPT-2: the tied head on the last stage),
ep2 x dp2 ZeRO-3 (Mixtral: experts sharded over edp, saved per expert), HSDP dp4 in pairs (Llama), tp2 x dp2 ZeRO-3
with the parameter shards on disk (NVMe offload), tp4 2D (GPT-2: grid blocks) - and saves it with the distributed
writer and with the earlier gathering save (``distributed=False``), both sharded small. Plain ``transformers`` loads
the two folders to exactly the same tensors, which differ from the starting checkpoint (the trained model) and equal
the model's own parameters (each rank's slice, exact); the files hold the keys, shapes and dtypes ``transformers``'
own ``save_pretrained`` writes; every byte is written once, by the rank the plan gave it, and every rank writes part
of it; the model's own ``save_pretrained`` writes the same bytes. A save that fails on one rank (a file-size limit
there) fails on every rank and leaves the previous folder as it was.

Memory, in one world of 4 ranks: a 118 MB GPT-2 at tp2 x dp2 ZeRO-3 (``training.save_pretrained``), pp2 x tp2 and
HSDP (dp4 in pairs), and a 74 MB Mixtral at ep2 x dp2 ZeRO-3 (the model's own ``save_pretrained``): the distributed
save's peak RSS over the rank's resident memory before it (its share) stays under its 4 MiB buffer plus 24 MiB of
slack on every rank, while the gathering save (``distributed=False``, the negative control) exceeds that bound and
half the model on some rank (rank 0 holds the whole model); both write the same Hub tensors. The offline
consolidation of a resumable checkpoint of the tp2 x dp2 ZeRO-3 model, shared by the 4 processes, stays under twice
the largest stored chunk plus the same, and writes the same files.
"""
from __future__ import annotations

import json
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

import oslo_models as om
from oslo_models import training
from tests.helpers.decoders import save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import expected_shard, save_tiny_gpt2, tp_local

SHARD = "60KB"
ADAMW = dict(lr=1e-2, weight_decay=0.1, eps=1e-6)


def _tensors(folder: str) -> dict[str, tuple]:
    """``{key: (shape, dtype)}`` of every tensor in a Hub folder's safetensors files."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    out[key] = (tuple(piece.get_shape()), piece.get_dtype())
    return out


def _step(model, optimizer, ids):
    ctx = training.unwrap_model(model).parallel_context
    if ctx.pp_size > 1:
        model.train_step(ids, labels=ids)
    else:
        local = ids.chunk(ctx.dp_size)[ctx.dp_rank]
        model(local, labels=local).loss.backward()
    optimizer.step(), optimizer.zero_grad()


def _check(name, model, optimizer, source, hf_class, root):
    breadcrumb(name)
    inner = training.unwrap_model(model)
    vocab = inner.config.vocab_size
    _step(model, optimizer, torch.randint(1, vocab, (4, 8), generator=torch.Generator().manual_seed(1)))
    new, old = os.path.join(root, name + "-new"), os.path.join(root, name + "-old")
    stats = training.save_pretrained(model, new, max_shard_size=SHARD)
    training.save_pretrained(model, old, max_shard_size=SHARD, distributed=False)
    own = os.path.join(root, name + "-own")
    inner.save_pretrained(own, max_shard_size=SHARD)  # the model's own method: the same writer, the same bytes
    written = [None] * dist.get_world_size()
    dist.all_gather_object(written, stats["bytes"])
    saved = hf_class.from_pretrained(new).state_dict()
    local = {n: tp_local(p.detach()) for n, p in inner.named_parameters()}
    if name != "mixtral-ep2-dp2-zero3":  # (Mixtral's stacked experts are saved per expert)
        for param_name, value in local.items():  # each rank: its slice of the saved tensor is its parameter
            key = param_name if param_name in saved else "transformer.wte.weight"  # GPT-2's tied head
            assert torch.equal(value, expected_shard(inner, param_name, saved[key])), (name, param_name)
    if dist.get_rank() == 0:
        gathered = hf_class.from_pretrained(old).state_dict()
        start = hf_class.from_pretrained(source).state_dict()
        assert saved.keys() == gathered.keys()
        for key, value in saved.items():
            assert value.dtype == gathered[key].dtype and torch.equal(value, gathered[key]), (name, key)
        assert any(not torch.equal(saved[k], start[k]) for k in saved), "not the trained parameters"
        reference = os.path.join(root, name + "-transformers")
        hf_class.from_pretrained(new).save_pretrained(reference)
        files = _tensors(new)
        assert files == _tensors(reference), name
        assert len([f for f in os.listdir(new) if f.endswith(".safetensors")]) > 1  # sharded, with an index
        with open(os.path.join(new, "model.safetensors.index.json")) as handle:
            index = json.load(handle)
        assert set(index["weight_map"]) == set(files)
        assert index["metadata"]["total_size"] == sum(written), (index["metadata"], written)  # each byte once
        with open(os.path.join(new, "config.json")) as a, open(os.path.join(old, "config.json")) as b:
            assert json.load(a) == json.load(b)
        assert all(count > 0 for count in written), (name, written)  # every rank writes its share
        assert sorted(os.listdir(own)) == sorted(os.listdir(new))
        for file in os.listdir(new):
            with open(os.path.join(new, file), "rb") as a, open(os.path.join(own, file), "rb") as b:
                assert a.read() == b.read(), (name, file)
    dist.barrier()


def _layouts_worker(paths: dict, root: str) -> None:
    def build(path, zero_stage=0, cls=om.AutoModelForCausalLM, **options):
        cfg = om.ParallelConfig(zero_stage=zero_stage, **options)
        model = cls.from_pretrained(path, parallel=cfg, progress=False).train()
        return training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), **ADAMW))

    model, opt = build(paths["gpt2"], 3, tensor_parallel_size=2)
    _check("gpt2-tp2-dp2-zero3", model, opt, paths["gpt2"], transformers.GPT2LMHeadModel, root)
    model, opt = build(paths["gpt2"], 1, tensor_parallel_size=2)  # whole tp-local parameters, replicated over dp
    _check("gpt2-tp2-dp2-zero1", model, opt, paths["gpt2"], transformers.GPT2LMHeadModel, root)
    model, opt = build(paths["llama"], 2)  # FSDP2 shards over dp 4, kept unsharded after forward
    _check("llama-dp4-zero2", model, opt, paths["llama"], transformers.LlamaForCausalLM, root)
    model, opt = build(paths["gpt2"], tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)
    _check("gpt2-pp2-tp2", model, opt, paths["gpt2"], transformers.GPT2LMHeadModel, root)
    model, opt = build(paths["mixtral"], 3, expert_parallel_size=2)
    _check("mixtral-ep2-dp2-zero3", model, opt, paths["mixtral"], transformers.MixtralForCausalLM, root)
    model, opt = build(paths["llama"], 3, data_parallel_size=4, data_parallel_shard_size=2)
    _check("llama-hsdp", model, opt, paths["llama"], transformers.LlamaForCausalLM, root)
    model, opt = build(paths["gpt2"], 3, tensor_parallel_size=2, offload="nvme", offload_params=True,
                       offload_path=os.path.join(root, "nvme"))  # parameter shards in a mapped file
    _check("gpt2-tp2-dp2-zero3-nvme", model, opt, paths["gpt2"], transformers.GPT2LMHeadModel, root)
    opt.close()
    model, opt = build(paths["gpt2"], tensor_parallel_size=4, tensor_parallel_mode="2d")
    _check("gpt2-tp4-2d", model, opt, paths["gpt2"], transformers.GPT2LMHeadModel, root)

    # a save that fails on one rank (a file-size limit there) fails on every rank; the previous folder stays as it was
    target = os.path.join(root, "gpt2-tp4-2d-new")
    before = {name: open(os.path.join(target, name), "rb").read() for name in sorted(os.listdir(target))}
    dist.barrier()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limit[1]))
    _step(model, opt, torch.randint(1, 100, (4, 8), generator=torch.Generator().manual_seed(3)))
    with pytest.raises(OSError, match="failed on rank 1"):
        training.save_pretrained(model, target, max_shard_size=SHARD)
    resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    dist.barrier()  # rank 0 removes the staging folder as it raises
    after = {name: open(os.path.join(target, name), "rb").read() for name in sorted(os.listdir(target))}
    assert after == before
    assert not [n for n in os.listdir(root) if n.startswith(".gpt2-tp4-2d-new.saving-")]  # staging removed


def test_distributed_export_equals_the_gathered_one(tmp_path):
    from tests.models.test_moe_parity import CONFIGS, HF

    paths = {"gpt2": save_tiny_gpt2(tmp_path / "gpt2"), "llama": save_tiny(tmp_path / "llama", "llama")}
    torch.manual_seed(0)
    HF["mixtral"](CONFIGS["mixtral"]()).save_pretrained(tmp_path / "mixtral")
    paths["mixtral"] = str(tmp_path / "mixtral")
    run_distributed(_layouts_worker, 4, paths, str(tmp_path), timeout=600)


# ---------------------------------------------------------------------------------------------- memory
BUFFER, SLACK = 4 * 2**20, 24 * 2**20


def _extra_peak(save) -> int:
    """Peak RSS while ``save()`` runs, over the RSS before it (``PeakRSS`` resets the high-water mark). Memory
    freed earlier is handed back to the system first (``malloc_trim``), so the save cannot hide in it."""
    import ctypes
    import gc

    from oslo_models.utils import PeakRSS

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    with PeakRSS() as peak:
        save()
    return peak.growth_bytes


MEMORY_LAYOUTS = (  # (name, checkpoint, ParallelConfig options, ZeRO stage, save through the model's own method)
    ("tp2-dp2-zero3", "gpt2", dict(tensor_parallel_size=2), 3, False),
    ("pp2-tp2", "gpt2", dict(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2), 0, True),
    ("ep2-dp2-zero3", "mixtral", dict(expert_parallel_size=2), 3, True),
    ("hsdp", "gpt2", dict(data_parallel_size=4, data_parallel_shard_size=2), 3, True),
)


def _memory_worker(paths: dict, root: str, full_bytes: dict) -> None:
    import gc
    import shutil

    import torch.distributed.checkpoint as dcp

    from oslo_models.conversion.consolidate import consolidate

    peaks, chunk = {}, None
    for name, source, options, zero_stage, own in MEMORY_LAYOUTS:
        breadcrumb(f"memory {name}")
        model = om.AutoModelForCausalLM.from_pretrained(paths[source], progress=False,
                                                        parallel=om.ParallelConfig(zero_stage=zero_stage, **options))
        if zero_stage:
            model, _ = training.shard_data_parallel(model, zero_stage=zero_stage)
        new, old = os.path.join(root, name, "new"), os.path.join(root, name, "old")
        if own:  # the model's own save_pretrained: the same distributed writer
            saved = _extra_peak(lambda: training.unwrap_model(model).save_pretrained(new, buffer_bytes=BUFFER))
        else:
            saved = _extra_peak(lambda: training.save_pretrained(model, new, buffer_bytes=BUFFER))
        merged = None
        if name == "tp2-dp2-zero3":  # the offline consolidation of a resumable checkpoint, shared by the 4
            ckpt = os.path.join(root, "ckpt")  # processes: one stored chunk at a time
            training.save_checkpoint(ckpt, model, step=1)
            reader = dcp.FileSystemReader(os.path.join(ckpt, "step-00000001"))
            chunk = max(c.sizes.numel() * m.properties.dtype.itemsize for m in
                        reader.read_metadata().state_dict_metadata.values() if hasattr(m, "chunks")
                        for c in m.chunks)
            merged = _extra_peak(lambda: consolidate(ckpt, os.path.join(root, "consolidated"), buffer_bytes=BUFFER))
        gathered = _extra_peak(lambda: training.save_pretrained(model, old, distributed=False))
        peaks[name] = [None] * 4
        dist.all_gather_object(peaks[name], (saved, gathered, merged))
        if dist.get_rank() == 0:
            mib = [tuple(None if x is None else round(x / 2**20, 1) for x in peak) for peak in peaks[name]]
            print(f"{name}: extra peak RSS per rank (MiB: distributed save, gathering save, consolidation), "
                  f"model {full_bytes[source] / 2**20:.0f} MiB: {mib}")
            for file in os.listdir(new):
                if file.endswith(".safetensors") and merged is not None:
                    with open(os.path.join(new, file), "rb") as a, \
                            open(os.path.join(root, "consolidated", file), "rb") as b:
                        assert a.read() == b.read(), file
            assert _tensors(new) == _tensors(old), name  # the same Hub tensors
        model = None  # the next layout's baseline without this one
        gc.collect()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(os.path.join(root, name))
    if dist.get_rank() == 0:
        for name, per_rank in peaks.items():
            source = next(layout[1] for layout in MEMORY_LAYOUTS if layout[0] == name)
            mib = [tuple(None if x is None else round(x / 2**20, 1) for x in peak) for peak in per_rank]
            assert all(a <= BUFFER + SLACK for a, _, _ in per_rank), (name, mib)
            # the negative control: the gathering save holds (far) more than the bound on some rank
            assert max(b for _, b, _ in per_rank) > max(BUFFER + SLACK, full_bytes[source] // 2), (name, mib)
            if name == "tp2-dp2-zero3":
                assert all(c <= 2 * chunk + BUFFER + SLACK for _, _, c in per_rank), (mib, chunk)


def test_distributed_export_memory_stays_within_the_buffer(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    torch.manual_seed(0)
    models = {"gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
                  n_embd=512, n_layer=8, n_head=8, vocab_size=8192, n_positions=64)),
              "mixtral": transformers.MixtralForCausalLM(transformers.MixtralConfig(
                  vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2,
                  max_position_embeddings=64))}
    full_bytes, paths = {}, {}
    for name, model in models.items():
        full_bytes[name] = sum(p.numel() * p.element_size() for p in model.parameters())
        paths[name] = str(tmp_path / name)
        model.save_pretrained(paths[name])
    del models, model
    run_distributed(_memory_worker, 4, paths, str(tmp_path / "work"), full_bytes, timeout=900)
