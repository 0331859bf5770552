"""``python -m oslo_models checkpoint consolidate`` / ``verify`` (issue 53).

A world of 4 trains one AdamW step at pp2 x tp2 (GPT-2, tied head on the last stage), ep2 x dp2 ZeRO-3 (Mixtral,
experts saved per expert), tp2 x dp2 ZeRO-3 with an asynchronous save (GPT-2) and ep2 x dp2 ZeRO-3 on the generic
path (dots1: its fused ``gate_up_proj`` is *converted* per expert by ``transformers`` on save, so the consolidation
converts it whole with a meta-device model of the saved config), and writes both a resumable
checkpoint and ``training.save_pretrained``'s Hub folder. Offline, the CLI turns each checkpoint into a Hub folder
byte for byte equal to the live export (shards, index, configs), in one process and under ``torchrun`` with 2
processes sharing the chunks (the other calls run the CLI's ``main`` in the test process: one process, no group).
``verify`` passes both kinds of folder and fails (exit 1, naming the file) on a flipped byte (against a saved
report), a truncated shard, an index that misplaces a key, and a corrupt training checkpoint file.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import torch

import oslo_models as om
from oslo_models import training
from oslo_models.cli import main
from tests.generic.models import save as save_generic
from tests.helpers.dist import free_port, run_distributed
from tests.helpers.models import save_tiny_gpt2

SHARD = "60KB"


def _save_worker(paths: dict, root: str) -> None:
    layouts = {"gpt2-pp2-tp2": ("gpt2", dict(tensor_parallel_size=2, pipeline_parallel_size=2, num_microbatches=2)),
               "mixtral-ep2-dp2": ("mixtral", dict(expert_parallel_size=2, zero_stage=3)),
               "gpt2-tp2-dp2-async": ("gpt2", dict(tensor_parallel_size=2, zero_stage=3)),
               "dots1-ep2-dp2": ("dots1", dict(expert_parallel_size=2, zero_stage=3))}
    for name, (family, options) in layouts.items():
        model = om.AutoModelForCausalLM.from_pretrained(paths[family], parallel=om.ParallelConfig(**options),
                                                        progress=False).train()
        model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ctx = training.unwrap_model(model).parallel_context
        ids = torch.randint(1, 60, (4, 8), generator=torch.Generator().manual_seed(2))
        if ctx.pp_size > 1:
            model.train_step(ids, labels=ids)
        else:
            local = ids.chunk(ctx.dp_size)[ctx.dp_rank]
            model(local, labels=local).loss.backward()
        opt.step(), opt.zero_grad()
        training.save_checkpoint(os.path.join(root, name, "ckpt"), model, opt, step=1, async_=name.endswith("async"))
        training.save_pretrained(model, os.path.join(root, name, "hub"), max_shard_size=SHARD)
        training.wait_for_checkpoint(model)


def _cli(*args, torchrun: int = 0) -> subprocess.CompletedProcess:
    """``oslo_models checkpoint *args``: in this process (one process: no group), or under ``torchrun``."""
    if not torchrun:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["checkpoint", *args])
            except SystemExit as refused:  # argparse's error(): a usage line and exit 2
                code = refused.code
        return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={torchrun}",
                f"--master-port={free_port()}", "-m", "oslo_models"]
    return subprocess.run([*launcher, "checkpoint", *args], capture_output=True, text=True, env=env, timeout=600)


def _same_folder(a: str, b: str) -> None:
    names = sorted(n for n in os.listdir(a) if n.endswith((".safetensors", ".json")))
    assert names == sorted(n for n in os.listdir(b) if n.endswith((".safetensors", ".json"))), (a, b)
    for name in names:
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
                assert x.read() == y.read(), name
        else:
            with open(os.path.join(a, name)) as x, open(os.path.join(b, name)) as y:
                assert json.load(x) == json.load(y), name


def test_consolidate_and_verify(tmp_path):
    from tests.models.test_moe_parity import CONFIGS, HF

    paths = {"gpt2": save_tiny_gpt2(tmp_path / "gpt2")}
    torch.manual_seed(0)
    HF["mixtral"](CONFIGS["mixtral"]()).save_pretrained(tmp_path / "mixtral")
    paths["mixtral"] = str(tmp_path / "mixtral")
    paths.update(save_generic(tmp_path, {"dots1": 0}))
    run_distributed(_save_worker, 4, paths, str(tmp_path), timeout=600)

    record = os.path.join(training.find_checkpoint(str(tmp_path / "dots1-ep2-dp2" / "ckpt")), "hub", "export.json")
    with open(record) as handle:
        exported = json.load(handle)
    assert any("converted" in value for value in exported["tensors"].values())  # the case this layout is here for
    for name in ("gpt2-pp2-tp2", "mixtral-ep2-dp2", "gpt2-tp2-dp2-async", "dots1-ep2-dp2"):
        ckpt, hub, out = (str(tmp_path / name / part) for part in ("ckpt", "hub", "consolidated"))
        done = _cli("consolidate", ckpt, out, "--max-shard-size", SHARD)
        assert done.returncode == 0, done.stderr[-3000:]
        _same_folder(out, hub)
        for folder in (ckpt, out):
            done = _cli("verify", folder)
            assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr[-3000:]
    ckpt, hub = str(tmp_path / "mixtral-ep2-dp2" / "ckpt"), str(tmp_path / "mixtral-ep2-dp2" / "hub")
    done = _cli("consolidate", ckpt, str(tmp_path / "two"), "--max-shard-size", SHARD, torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bytes written per process" in done.stdout and ", 0]" not in done.stdout, done.stdout
    _same_folder(str(tmp_path / "two"), hub)
    ckpt, hub = str(tmp_path / "dots1-ep2-dp2" / "ckpt"), str(tmp_path / "dots1-ep2-dp2" / "hub")
    done = _cli("consolidate", ckpt, str(tmp_path / "dots1-two"), "--max-shard-size", SHARD, torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_folder(str(tmp_path / "dots1-two"), hub)
    # a recorded conversion the saved config's model does not reproduce is refused before anything is written
    tampered = str(tmp_path / "dots1-tampered")
    shutil.copytree(ckpt, tampered)
    key = next(k for k, v in exported["tensors"].items() if "converted" in v)
    exported["tensors"][key]["converted"][0][0] += ".renamed"
    with open(os.path.join(training.find_checkpoint(tampered), "hub", "export.json"), "w") as handle:
        json.dump(exported, handle)
    done = _cli("consolidate", tampered, str(tmp_path / "dots1-refused"), "--max-shard-size", SHARD)
    assert done.returncode != 0 and "training.save_pretrained" in done.stderr, done.stderr[-3000:]
    assert not os.path.exists(tmp_path / "dots1-refused")

    # verify's negative controls
    report = str(tmp_path / "report.json")
    assert _cli("verify", hub, "--json", report).returncode == 0
    shard = sorted(n for n in os.listdir(hub) if n.endswith(".safetensors"))[0]
    for breakage in ("flip", "truncate", "index"):
        broken = str(tmp_path / f"broken-{breakage}")
        shutil.copytree(hub, broken)
        path = os.path.join(broken, shard)
        if breakage == "flip":
            with open(path, "r+b") as handle:
                handle.seek(-5, os.SEEK_END)
                byte = handle.read(1)
                handle.seek(-5, os.SEEK_END)
                handle.write(bytes([byte[0] ^ 1]))
        elif breakage == "truncate":
            os.truncate(path, os.path.getsize(path) - 4)
        else:
            index_path = os.path.join(broken, "model.safetensors.index.json")
            with open(index_path) as handle:
                index = json.load(handle)
            key = next(k for k, v in index["weight_map"].items() if v == shard)
            index["weight_map"][key] = sorted(set(index["weight_map"].values()) - {shard})[0]
            with open(index_path, "w") as handle:
                json.dump(index, handle)
        done = _cli("verify", broken, "--expect", report)
        assert done.returncode == 1 and "FAILED" in done.stderr, (breakage, done.stdout, done.stderr)
        assert shard in done.stderr or breakage == "index", (breakage, done.stderr)
    step = training.find_checkpoint(ckpt)
    distcp = sorted(n for n in os.listdir(step) if n.endswith(".distcp"))[0]
    with open(os.path.join(step, distcp), "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00\x01")
    done = _cli("verify", ckpt)
    assert done.returncode == 1 and distcp in done.stderr, done.stderr
