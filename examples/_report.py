"""What the example scripts report: Accelerate trackers (``--report-to``), ``loss.json``, ``loss.png`` (when
matplotlib is installed) and the ``--push-to-hub`` upload.

``--report-to`` takes Accelerate's tracker names (``tensorboard``, ``wandb``, ``mlflow``, ..., ``all``), passed to
``Accelerator(log_with=...)`` and started with ``accelerator.init_trackers``, plus ``jsonl``: :class:`JsonlTracker`,
one JSON line per ``accelerator.log`` call in ``OUTPUT/metrics.jsonl``, which needs nothing installed.
"""
from __future__ import annotations

import json
import os

from accelerate.tracking import GeneralTracker


class JsonlTracker(GeneralTracker):
    """An Accelerate tracker writing ``{"step": ..., **values}`` lines to ``<logging_dir>/metrics.jsonl`` (main
    process only) and the run configuration to ``<logging_dir>/run_config.json``."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str):
        super().__init__()
        self.run_name, self.logging_dir = run_name, logging_dir
        self.path = os.path.join(logging_dir, "metrics.jsonl")

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict) -> None:
        os.makedirs(self.logging_dir, exist_ok=True)
        with open(os.path.join(self.logging_dir, "run_config.json"), "w", encoding="utf-8") as handle:
            json.dump(values, handle, indent=1, default=str)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        os.makedirs(self.logging_dir, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"step": step, **values}) + "\n")


def tracker_names(args) -> list[str]:
    return [name.strip() for name in str(args.report_to).split(",") if name.strip() and name.strip() != "none"]


def check_trackers(args) -> str | None:
    """What is wrong with ``--report-to`` (an unknown or uninstalled tracker), or ``None``. Accelerate itself
    drops an uninstalled tracker with a debug-level message only."""
    from accelerate.tracking import LoggerType, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    for name in tracker_names(args):
        if name in ("jsonl", "all"):
            continue
        if name not in {str(t) for t in LoggerType}:
            return f"--report-to {name}: unknown tracker; choose from jsonl, " + ", ".join(str(t) for t in LoggerType)
        if name not in available:
            return f"--report-to {name}: its package is not installed (pip install {name})"
    return None


def trackers(args) -> list:
    """``log_with`` for the Accelerator from ``--report-to`` (``[]`` for ``none``)."""
    return [JsonlTracker("train", args.output) if name == "jsonl" else name for name in tracker_names(args)]


class Reporter:
    """Logs to the trackers (started here with the run's options as their configuration) and keeps the
    evaluations for ``loss.json``."""

    def __init__(self, args, accelerator):
        self.accelerator, self.evaluations = accelerator, []
        if accelerator.log_with:
            accelerator.init_trackers(os.path.basename(os.path.abspath(args.output)), config=_scalars(vars(args)))

    def log(self, values: dict, step: int) -> None:
        if self.accelerator.log_with:
            self.accelerator.log(values, step=step)

    def log_eval(self, result: dict, step: int, write) -> None:
        self.evaluations.append({"step": step, **result})
        # every figure the evaluator gives (loss and perplexity; a classifier's accuracy and F1)
        figures = {key: value for key, value in result.items() if key != "samples"}
        self.log({f"eval/{key}": value for key, value in figures.items()}, step)
        if self.accelerator.is_main_process:
            shown = "  ".join(f"eval loss {value:.4f}" if key == "loss" else
                              f"{key} {value:.2f}" if key == "perplexity" else f"{key} {value:.4f}"
                              for key, value in figures.items())
            write(f"step {step:5d}  {shown} ({result['samples']} held-out samples)")


def _scalars(values: dict) -> dict:
    # trackers (tensorboard hparams) take int/float/str/bool only
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}


def plot_losses(losses: list[float], path: str, title: str) -> bool:
    """``loss.png``; ``False`` (nothing drawn) when matplotlib is not installed: the plot is a nicety."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def push_folder(repo_id: str, folder: str, api=None) -> str:
    """Upload ``folder`` (model + tokenizer) to the Hub model repo ``repo_id`` (created if missing); returns its
    URL. ``api``: an ``huggingface_hub.HfApi`` (default: one with the logged-in token)."""
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="Upload model trained with oslo_models")
    return f"https://huggingface.co/{repo_id}"


def export_files(args, accelerator, losses: list[float], reporter: Reporter, title: str, model_dir: str) -> None:
    """Rank 0: ``loss.json`` first (the data), then ``loss.png``, then the ``--push-to-hub`` upload."""
    with open(os.path.join(args.output, "loss.json"), "w", encoding="utf-8") as handle:
        json.dump({"losses": losses, "eval": reporter.evaluations,
                   "mixed_precision": str(accelerator.mixed_precision), "args": vars(args)}, handle, indent=1)
    if not plot_losses(losses, os.path.join(args.output, "loss.png"), title):
        print("loss.png skipped: matplotlib is not installed (pip install matplotlib); the data is in loss.json")
    if args.push_to_hub:
        print(f"uploaded {model_dir} to {push_folder(args.push_to_hub, model_dir)}")
