"""The example scripts and the CLI as people start them: fast ``import oslo_models`` (nothing heavy imported
eagerly), launch errors found before anything is built (one line from rank 0, every rank exits 2), tokenizer
checks, ``--push-to-hub`` in every script (upload mocked), ``--help`` with defaults."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = ("train_clm", "train_mlm", "train_seq2seq")
HEAVY = ("torch.distributed.pipelining", "torch._dynamo", "torch.distributed.checkpoint")


@pytest.fixture(scope="module")
def examples():
    """The example scripts as modules (their folder on sys.path, as when they run)."""
    import importlib

    names = ("_common", "_data", "_report", *SCRIPTS)
    # fresh modules: another test may have left some of them imported (say `_data` bound to an older `_common`,
    # whose UsageError is then another class than this `_common`'s)
    for name in names:
        sys.modules.pop(name, None)
    sys.path.insert(0, EXAMPLES)
    try:
        yield {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(EXAMPLES)


def _python(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args] if not code else [sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_import_is_lazy_and_pipelining_is_imported_on_use():
    """``import oslo_models`` imports neither torch nor transformers; ``om.training``/``om.data`` import no
    pipelining, dynamo or distributed checkpoint; the model classes no pipelining (nor does ``python -m
    oslo_models --help``); ``om.pipeline`` does."""
    code = f"""
import sys, time
start = time.perf_counter()
import oslo_models as om
seconds = time.perf_counter() - start
heavy = {HEAVY!r}
assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)
assert seconds < 2.0, seconds
om.training.save_checkpoint, om.training.clip_grad_norm_, om.data.build_dataloader, om.ParallelContext
assert 'oslo_models.training.checkpoint' in sys.modules and 'oslo_models.pipeline.stage' in sys.modules
assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]
om.AutoModelForCausalLM, om.AutoModelForSeq2SeqLM  # transformers' model code imports dynamo and dcp itself
assert 'torch.distributed.pipelining' not in sys.modules
assert om.pipeline.PipelineRunner.__name__ == 'PipelineRunner' and 'torch.distributed.pipelining' in sys.modules
from oslo_models import *
print('ok', round(seconds, 3))
"""
    result = _python(code)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr
    result = _python("", "-c", "import runpy, sys; sys.argv = ['oslo_models', '--help']\n"
                     "try:\n    runpy.run_module('oslo_models', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                     f"assert not any(m in sys.modules for m in {HEAVY!r} + ('torch',)), 'heavy import'")
    assert result.returncode == 0 and "pipeline-plot" in result.stdout, result.stdout + result.stderr


def test_check_launch_refuses_before_building(examples, monkeypatch):
    common = examples["_common"]
    parse = examples["train_clm"].parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    cases = {
        ("--tp", "3"): "does not divide",
        ("--dp-shard", "3", "--zero", "3"): "data_parallel_shard_size=3 must divide data_parallel_size=4",
        ("--dp-shard", "2", "--zero", "1"): "data_parallel_shard_size=2 .* needs zero_stage 2 or 3",
        ("--pp", "2", "--mixed-precision", "fp16"): "fp16 needs a GPU",  # composes with pp; not on a CPU
        ("--pp", "2", "--grad-accum", "2"): "gradient_accumulation_steps > 1 with pipeline_parallel_size > 1",
        ("--pp", "2", "--microbatches", "3"): "does not split into --microbatches 3",
        ("--tp", "2", "--cpu-offload"): "cpu_offload needs zero_stage 2 or 3",
        ("--report-to", "nosuchtracker"): "unknown tracker",
        ("--cp", "3"): "context_parallel_size=3",
        ("--cp", "2", "--cp-mode", "all_to_all", "--tp", "3"): "does not divide",
        ("--tp", "2", "--tp-mode", "2d"): "2d",
        ("--compile", "nosuchbackend"): "unknown backend",
        ("--zero", "3", "--offload", "nvme"): "offload='nvme' needs offload_path",
        ("--zero", "3", "--offload", "nvme", "--offload-path", "x", "--cpu-offload"): "cannot be combined",
        ("--zero", "1", "--offload", "nvme", "--offload-path", "x"): "zero_stage=1 is not implemented",
    }
    for argv, message in cases.items():
        with pytest.raises(common.UsageError, match=message):
            common.check_launch(parse(list(argv)))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch --mixed_precision fp16` sets
    with pytest.raises(common.UsageError, match="fp16 needs a GPU"):
        common.check_launch(parse(["--pp", "2"]))
    assert common.check_launch(parse(["--pp", "2", "--mixed-precision", "bf16"])).pipeline_parallel_size == 2
    assert common.check_launch(parse(["--pp", "2", "--mixed-precision", "no"])).pipeline_parallel_size == 2
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert common.check_launch(parse(["--tp", "2", "--zero", "2"])).resolve_data_parallel_size(4) == 2
    assert common.check_launch(parse(["--pp", "2", "--zero", "3"])).zero_stage == 3  # FSDP2 per pipeline stage
    assert common.check_launch(parse(["--zero", "3", "--dp-shard", "2"])).data_parallel_shard_size == 2
    with pytest.raises(SystemExit):  # argparse: conflicting precision flags
        parse(["--bf16", "--mixed-precision", "no"])
    # every axis reaches the config; no option is a prefix of another (``--cp 2`` is not ``--cpu-offload 2``)
    cfg = common.check_launch(parse(["--cp", "2", "--cp-mode", "all_to_all", "--tp", "2", "--activation-checkpointing",
                                     "selective"]))
    assert (cfg.context_parallel_size, cfg.context_parallel_mode, cfg.activation_checkpointing) == (
        2, "all_to_all", "selective")
    assert common.check_launch(parse(["--ep", "2"])).expert_parallel_size == 2
    assert common.check_launch(parse(["--zero", "2", "--cpu-offload"])).offload == "cpu"  # the older spelling
    nvme = common.check_launch(parse(["--zero", "3", "--offload", "nvme", "--offload-path", "/scratch/run1"]))
    assert (nvme.offload, nvme.offload_path) == ("nvme", "/scratch/run1")
    grid = common.check_launch(parse(["--tp", "4", "--tp-mode", "2d"]))
    assert (grid.tensor_parallel_mode, grid.tensor_parallel_size) == ("2d", 4)
    assert parse(["--compile"]).compile == "inductor"
    with pytest.raises(SystemExit):
        parse(["--cpu", "2"])  # an abbreviation of --cpu-offload is refused, not guessed


def test_tokenizer_checks(examples, tmp_path):
    common = examples["_common"]
    parse = examples["train_clm"].parse_args
    bare = tmp_path / "bare"  # a model folder without tokenizer files
    transformers.GPT2Config(vocab_size=5, n_embd=8, n_layer=1, n_head=2).save_pretrained(bare)
    with pytest.raises(common.UsageError, match="no tokenizer files.*--tokenizer"):
        examples["_data"].tokenizer_source(parse(["--model", str(bare)]))
    tokenizer_dir = tmp_path / "tok"
    examples["train_clm"].train_tokenizer(os.path.join(EXAMPLES, "data", "public_domain.txt"), str(tokenizer_dir), 300)
    args = parse(["--model", str(bare), "--tokenizer", str(tokenizer_dir)])
    assert examples["_data"].tokenizer_source(args) == str(tokenizer_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(common.UsageError, match=r"has \d+ tokens but .* embeds 5"):
        examples["_data"].check_tokenizer(args, tokenizer)
    other = tmp_path / "other"  # a second tokenizer, trained on another vocabulary size
    examples["train_clm"].train_tokenizer(os.path.join(EXAMPLES, "data", "public_domain.txt"), str(other), 280)
    text = tmp_path / "corpus.txt"
    text.write_text("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate.\n")
    import oslo_models as om

    om.data.preprocess(str(text), str(tmp_path / "corpus"), str(tokenizer_dir), show_progress=False)
    examples["_data"].check_corpus(tokenizer, str(tmp_path / "corpus"), None)
    with pytest.raises(common.UsageError, match="tokenizer mismatch.*own --tokenizer"):
        examples["_data"].check_corpus(transformers.AutoTokenizer.from_pretrained(other), str(tmp_path / "corpus"))
    fits = tmp_path / "fits"
    transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=8, n_layer=1, n_head=2).save_pretrained(fits)
    examples["_data"].check_tokenizer(parse(["--model", str(fits), "--tokenizer", str(tokenizer_dir)]), tokenizer)


def test_every_script_pushes_to_hub_and_shows_defaults(examples, tmp_path):
    calls = []

    class FakeApi:  # huggingface_hub.HfApi's two calls, recorded instead of sent
        def create_repo(self, repo_id, exist_ok):
            calls.append(("create_repo", repo_id, exist_ok))

        def upload_folder(self, repo_id, folder_path, commit_message):
            calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path))))

    for name in SCRIPTS:
        module = examples[name]
        assert module.parse_args(["--push-to-hub", "me/tiny"]).push_to_hub == "me/tiny"
        text = module.parse_args.__globals__["build_parser"](module.__doc__, output="o", model_help="m").format_help()
        assert "(default: 200)" in text and "--eval-data" in text and "--tokenizer" in text
        assert module.__doc__.split("\n\n")[0].strip().endswith(".")  # the description is not cut mid-sentence
    (tmp_path / "config.json").write_text("{}")
    url = examples["_report"].push_folder("me/tiny", str(tmp_path), api=FakeApi())
    assert url.endswith("me/tiny") and calls == [("create_repo", "me/tiny", True),
                                                 ("upload_folder", "me/tiny", ["config.json"])]


def test_launch_error_is_one_line_from_rank_zero(tmp_path):
    """``--tp 3`` on 2 processes: the clear error once (not once per rank with tracebacks), exit status 2 on every
    rank, before any model or data is built."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    start = time.perf_counter()
    result = subprocess.run([torchrun, "--nproc_per_node", "2", os.path.join(EXAMPLES, "train_clm.py"), "--tp", "3",
                             "--output", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    seconds = time.perf_counter() - start
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert output.count("train_clm.py: error: The launched world has 2 process(es)") == 1, output
    assert "Traceback" not in output.split("train_clm.py: error:")[0] and "exitcode: 2" in output, output
    assert not (tmp_path / "out").exists()  # nothing was built
    assert seconds < 90, seconds


def test_help_formatter_hides_empty_defaults():
    from oslo_models.cli import HelpFormatter, build_parser

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    parser.add_argument("--a", default=3, help="x")
    parser.add_argument("--b", help="y")
    text = parser.format_help()
    assert "x (default: 3)" in text and "y (default" not in text
    plot = build_parser().parse_args(["pipeline-plot", "--pp", "2", "--microbatches", "4", "--virtual", "2"])
    assert plot.virtual_stages == 2


def test_lm_logits_are_not_views():
    """FSDP2 (ZeRO-2/3) warns once per rank when a wrapped model returns a view; GPT-2's gathered LM logits are a
    fresh tensor when the vocabulary is not padded (tp=1 or a vocabulary divisible by tp)."""
    import torch

    import oslo_models as om

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=96)
    out = om.AutoModelForCausalLM.from_config(config).train()(input_ids=ids, labels=ids)
    assert out.logits._base is None and out.logits.shape == (2, 8, 96)
