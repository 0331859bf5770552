"""The README's ```python blocks, and the guides' blocks marked ``<!-- test -->`` on the line before them, run here
in one process on a tiny GPT-2 saved locally (Hub names such as ``"gpt2"`` are replaced by its folder); paths the
blocks and launch lines name (``examples/...``) must exist. Blocks marked ``<!-- test: N -->`` run on N processes
(``test_multiprocess_blocks.py``)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!-- test(?:: (\d+))? -->\n)?```(python|bash)\n(.*?)```", re.S)


def code_blocks(page: Path, language: str, marked_only: bool, world_size: int = 1) -> list[str]:
    """The ``language`` blocks of ``page`` (when ``marked_only``: only those marked ``<!-- test -->``, or
    ``<!-- test: N -->`` for ``world_size`` N)."""
    text = page.read_text(encoding="utf-8")
    found = [(match.group(0).startswith("<!--"), int(match.group(1) or 1), match.group(2), match.group(3))
             for match in BLOCK.finditer(text)]
    return [code for marked, world, lang, code in found
            if lang == language and (not marked_only or (marked and world == world_size))]


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = [("README.md", code) for code in code_blocks(ROOT / "README.md", "python", marked_only=False)]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        blocks += [(str(page.relative_to(ROOT)), code) for code in code_blocks(page, "python", marked_only=True)]
    return blocks


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A 2-layer GPT-2 (hidden 64, vocabulary 101) saved as a Hub folder, standing in for ``"gpt2"``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=128)
    folder = tmp_path_factory.mktemp("hub") / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_there_are_blocks_to_run():
    assert any(page == "README.md" for page, _ in runnable_blocks()), "the README quickstart block went missing"


@pytest.mark.parametrize("page, code", runnable_blocks(), ids=lambda value: value if value.endswith(".md") else "")
def test_python_block_runs(page, code, tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # one process: the blocks' plain single-process path
    source = code.replace('"gpt2"', repr(str(tiny_gpt2)))
    namespace = {"__name__": "__docs_block__"}
    exec(compile(source, f"{page} (code block)", "exec"), namespace)
    if "model" in namespace and "save_pretrained" in source:
        import transformers

        saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # plain transformers opens it
        assert saved.config.n_layer == 2


def test_paths_named_in_code_blocks_exist():
    """Every ``examples/...`` file a README or guide block names (scripts, the Slurm and accelerate files) exists."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    named = {path for page in pages for language in ("bash", "python")
             for code in code_blocks(page, language, marked_only=False)
             for path in re.findall(r"\bexamples/[\w./-]+\.(?:py|yaml|sbatch|sh)", code)}
    assert named, "no example paths found: the extraction is broken"
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert not missing, f"code blocks name files that do not exist: {missing}"


def launch_lines() -> list[tuple[str, list[str]]]:
    """(script, options) of every ``examples/train_*.py`` launch in the README's and the launch guide's bash blocks
    and in the Slurm script (continuation lines joined; the sbatch's ``"$@"`` stands for the README's extra options)."""
    lines = []
    for page in (ROOT / "README.md", ROOT / "docs" / "launch.md", ROOT / "examples" / "slurm" / "train.sbatch"):
        text = page.read_text(encoding="utf-8")
        codes = [text] if page.suffix == ".sbatch" else code_blocks(page, "bash", marked_only=False)
        for code in codes:
            for line in code.replace("\\\n", " ").splitlines():
                match = re.search(r"examples/(train_\w+)\.py((?:\s+--?[\w-]+(?:\s+[^-\s#][^\s#]*)?)*)", line)
                if match:
                    options = [word for word in match.group(2).split() if not word.startswith("$")]
                    lines.append((match.group(1), options))
    return lines


def test_launch_recipes_parse():
    """The launch recipes' script options exist (each parsed by the script's own parser, no process started), and
    the accelerate config file is one accelerate reads."""
    import importlib
    import sys

    from accelerate.commands.config.config_args import ClusterConfig

    recipes = launch_lines()
    assert len(recipes) >= 4, recipes
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        for script, options in recipes:
            importlib.import_module(script).parse_args(options)  # argparse exits (SystemExit) on an unknown option
    finally:
        sys.path.remove(str(ROOT / "examples"))
    config = ClusterConfig.from_yaml_file(str(ROOT / "examples" / "accelerate" / "multi_gpu.yaml"))
    assert config.num_processes == 8 and config.mixed_precision == "bf16"
