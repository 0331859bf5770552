"""``python -m oslo_models checkpoint {consolidate,verify}``: Hub folders from training checkpoints, and checks.

    python -m oslo_models checkpoint consolidate out/checkpoint out/hub [--max-shard-size 5GB]
    torchrun --nproc-per-node 8 -m oslo_models checkpoint consolidate out/checkpoint out/hub   # 8 processes share it
    python -m oslo_models checkpoint verify out/hub [--json report.json] [--expect report.json]
    python -m oslo_models checkpoint verify out/checkpoint      # the newest complete step's checksums

``consolidate`` (``conversion/consolidate.py``) needs no model code, no GPU and no more memory per process than one
stored chunk; under ``torchrun`` the processes share the chunks (gloo). ``verify`` (``conversion/verify.py``) exits
with status 1 and lists the problems when the folder is not whole and consistent.
"""
from __future__ import annotations

import json
import os
import sys


def add_parser(commands, formatter_class) -> None:
    checkpoint = commands.add_parser("checkpoint", help="consolidate a training checkpoint into a Hub folder; verify",
                                     formatter_class=formatter_class, description=__doc__.split("\n\n")[0])
    actions = checkpoint.add_subparsers(dest="action", required=True)
    merge = actions.add_parser("consolidate", formatter_class=formatter_class,
                               help="a save_checkpoint folder (any layout) -> a plain Hub folder, offline")
    merge.add_argument("checkpoint", help="a save_checkpoint folder (its newest complete step) or a step-N folder")
    merge.add_argument("output", help="the Hub folder to write (replaced atomically when it exists)")
    merge.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, as save_pretrained")
    merge.add_argument("--buffer-bytes", type=int, default=256 * 2**20,
                       help="host copy per write (a chunk that is not contiguous in its Hub tensor)")
    merge.set_defaults(handler=_consolidate)
    check = actions.add_parser("verify", formatter_class=formatter_class,
                               help="check a Hub folder (headers, index, hashes) or a training checkpoint (checksums)")
    check.add_argument("folder", help="a Hub folder, a save_checkpoint folder or a step-N folder")
    check.add_argument("--json", metavar="REPORT", help="also write the report (files' sizes and SHA-256) here")
    check.add_argument("--expect", metavar="REPORT", help="a report written earlier: every file must match it")
    check.set_defaults(handler=_verify)


def _consolidate(args) -> int:
    import torch.distributed as dist

    from .consolidate import consolidate

    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():  # torchrun: share the work
        dist.init_process_group("gloo")
        started = True
    try:
        stats = consolidate(args.checkpoint, args.output, max_shard_size=args.max_shard_size,
                            buffer_bytes=args.buffer_bytes)
        everyone = [stats]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, stats)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"{args.output}: {stats['total_bytes']} bytes ({', '.join(stats['dtypes'])}) from {args.checkpoint}; "
                  f"bytes written per process: {[s['bytes'] for s in everyone]}")
        if started:
            dist.barrier()  # no rank tears its gloo pairs down while a peer still talks to it (success path only)
    finally:
        if started:
            dist.destroy_process_group()
    return 0


def _verify(args) -> int:
    from .verify import verify

    expect = None
    if args.expect:
        with open(args.expect, encoding="utf-8") as handle:
            expect = json.load(handle)
    report = verify(args.folder, expect)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1, sort_keys=True)
    what = f"{report['kind']} folder {report['folder']}"
    if report["ok"]:
        extra = f", {report['tensors']} tensors in {len(report['files'])} files" if report["kind"] == "hub" else ""
        print(f"OK: {what}{extra}")
        return 0
    print(f"FAILED: {what}", file=sys.stderr)
    for problem in report["problems"]:
        print(f"  {problem}", file=sys.stderr)
    return 1
