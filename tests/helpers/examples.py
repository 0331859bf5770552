"""Running the example scripts in tests: the launch command, an eval file, a matplotlib-less environment, and the
reference held-out loss of a saved checkpoint computed with plain ``transformers``."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
CORPUS = os.path.join(EXAMPLES, "data", "public_domain.txt")
TINY = ("--seq-len", "32", "--n-embd", "64", "--batch-size", "4")


def eval_file(folder) -> str:
    """The corpus' last 20 paragraphs as a held-out text file (the same text tokenized with the run's tokenizer)."""
    path = os.path.join(folder, "eval.txt")
    with open(CORPUS, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines[-20:]) + "\n")
    return path


def without_matplotlib(folder) -> str:
    """A folder to put first on PYTHONPATH in which ``import matplotlib`` fails as when it is not installed."""
    package = os.path.join(folder, "no_matplotlib", "matplotlib")
    os.makedirs(package, exist_ok=True)
    with open(os.path.join(package, "__init__.py"), "w", encoding="utf-8") as handle:
        handle.write("raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    return os.path.dirname(package)


def launch(launcher: list[str], script: str, *args: str, timeout: int = 300, pythonpath: str = ROOT,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """``launcher + [examples/script, *args]`` with the tree on PYTHONPATH; asserts exit status 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath, **(env or {}))
    result = subprocess.run([*launcher, os.path.join(EXAMPLES, script), *args], env=env, capture_output=True,
                            text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def torchrun(nproc: int) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(nproc)]


def read_run(out) -> tuple[dict, list[dict]]:
    """``(loss.json, metrics.jsonl lines)`` of a run's output folder."""
    report = json.loads((out / "loss.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return report, metrics


@torch.no_grad()
def plain_eval_loss(model, prefix: str, sample_len: int, collator, batch_size: int, samples: int) -> float:
    """The examples' evaluation done with a plain ``transformers`` model: held-out windows in file order, batches
    of ``batch_size``, mean of the batch losses."""
    import oslo_models as om

    dataset = om.data.PackedCausalLMDataset(prefix, sample_len, shuffle=False, num_epochs=1)
    model.eval()
    losses = [model(**collator([dataset[i] for i in range(start, start + batch_size)])).loss
              for start in range(0, samples, batch_size)]
    loss = torch.stack(losses).mean().item()
    assert math.isfinite(loss)
    return loss
