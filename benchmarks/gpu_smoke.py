"""GPU smoke test of the zoo: every causal-LM family record on one CUDA device, real Triton kernels, NCCL.

    PYTHONPATH=. torchrun --nproc_per_node 1 benchmarks/gpu_smoke.py --json gpu_smoke.json

The CPU suite checks parity with the Triton interpreter and gloo; this runs the same comparison where users run:
for each model type with a causal LM head (its tiny model from the family record), plain ``transformers`` and this
project's model are built from the same weights on the GPU, and

- fp32 (TF32 off): logits and loss on a left-padded batch, and every parameter's gradient, must agree (atol 1e-4:
  cuBLAS picks different kernels for the fused and unfused shapes, so the CPU suite's 1e-5 is not the bound here);
- bf16 autocast: the loss must agree within 2e-2 (relative), as two bf16 programs of the same maths do;
- the process group is NCCL (world 1): the loss is all-reduced through it, which fails if NCCL cannot run.

Prints one row per type, writes JSON, and exits non-zero when any type fails.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import oslo_models as om  # noqa: E402
from oslo_models.models.registry import families  # noqa: E402
from tests.helpers.zoo import tiny_config  # noqa: E402


def _batch(vocab: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 3] = -100  # predicted from the last pad position, whose logits padding leaves undefined
    return ids.to(device), mask.to(device), labels.to(device)


def _check(model_type: str, device: torch.device, workdir: str) -> dict:
    torch.manual_seed(0)
    config = tiny_config(model_type)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device).eval()
    path = os.path.join(workdir, model_type)
    reference.save_pretrained(path)
    ours = om.AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    ids, mask, labels = _batch(config.vocab_size, device)
    out_ref = reference(input_ids=ids, attention_mask=mask, labels=labels)
    out = ours(input_ids=ids, attention_mask=mask, labels=labels)
    out_ref.loss.backward()
    out.loss.backward()
    valid = mask.bool()
    logits_diff = (out.logits[valid].float() - out_ref.logits[valid].float()).abs().max().item()
    loss_diff = abs(out.loss.item() - out_ref.loss.item())
    ref_grads = dict(reference.named_parameters())
    grad_diff = max((p.grad - ref_grads[name].grad).abs().max().item()
                    for name, p in ours.named_parameters() if p.grad is not None and name in ref_grads)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss_bf16_ref = reference(input_ids=ids, attention_mask=mask, labels=labels).loss.float()
        loss_bf16 = ours(input_ids=ids, attention_mask=mask, labels=labels).loss.float()
    total = loss_bf16.detach().clone()
    dist.all_reduce(total)  # NCCL on the GPU, world 1
    bf16_rel = abs(total.item() - loss_bf16_ref.item()) / abs(loss_bf16_ref.item())
    experts_eager = None
    if getattr(reference.config, "_experts_implementation", None) is not None and hasattr(
            reference, "set_experts_implementation"):
        # transformers' MoE experts default to a grouped-matmul kernel on CUDA; its own eager loop tells a
        # difference of kernels from a difference of maths.
        reference.set_experts_implementation("eager")
        with torch.no_grad():
            eager_logits = reference(input_ids=ids, attention_mask=mask).logits
        experts_eager = (out.logits[valid].float() - eager_logits[valid].float()).abs().max().item()
    ok = logits_diff < 1e-4 and loss_diff < 1e-4 and grad_diff < 1e-4 and bf16_rel < 2e-2
    return dict(model_type=model_type, ok=ok, logits=logits_diff, loss=loss_diff, grads=grad_diff, bf16_rel=bf16_rel,
                logits_vs_eager_experts=experts_eager)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="gpu_smoke.json")
    parser.add_argument("--types", default=None, help="comma-separated model types (default: every causal LM record)")
    parser.add_argument("--cpu", action="store_true", help="check the script on CPU (gloo, Triton interpreter)")
    args = parser.parse_args()
    if args.cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this smoke test needs one (--cpu checks the script)")
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    types = args.types.split(",") if args.types else [r.model_type for r in families() if "causal_lm" in r.classes]
    rows = []
    print(f"# {name}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'type':<22}{'ok':<6}{'logits':>10}{'loss':>10}{'grads':>10}{'bf16 rel':>10}{'eager experts':>15}")
    with tempfile.TemporaryDirectory() as workdir:
        for model_type in types:
            try:
                row = _check(model_type, device, workdir)
            except Exception as error:  # one type's failure must not hide the others
                row = dict(model_type=model_type, ok=False, error=f"{type(error).__name__}: {error}"[:500])
                traceback.print_exc()
            rows.append(row)
            if "error" in row:
                print(f"{model_type:<22}{'FAIL':<6}{row['error'][:120]}")
            else:
                print(f"{model_type:<22}{'ok' if row['ok'] else 'FAIL':<6}{row['logits']:>10.1e}{row['loss']:>10.1e}"
                      f"{row['grads']:>10.1e}{row['bf16_rel']:>10.1e}"
                      + ("" if row["logits_vs_eager_experts"] is None
                         else f"{row['logits_vs_eager_experts']:>15.1e}"))
    with open(args.json, "w") as handle:
        json.dump(dict(device=name, torch=torch.__version__,
                       transformers=transformers.__version__, date=datetime.date.today().isoformat(), rows=rows),
                  handle, indent=1)
    dist.destroy_process_group()
    failed = [row["model_type"] for row in rows if not row["ok"]]
    print(f"# {len(rows) - len(failed)}/{len(rows)} types pass" + (f"; failed: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
