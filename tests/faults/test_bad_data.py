"""A corpus that cannot be trained on is a clear error naming the file before training starts.

``.bin``/``.idx`` pairs that do not match (another corpus' ``.bin`` of another size, or of the same size), a
truncated ``.bin`` or ``.idx``, and ids beyond the model's vocabulary: ``examples/_data.prepare_data`` (what every
example runs before building the loader) raises a ``UsageError`` naming the file; one real run of
``train_clm.py`` shows it is one line and exit status 2, with no checkpoint written. Negative controls: without the
new checks (an index written before fingerprints existed, the dataset read directly) the same files are read
silently, ids past the vocabulary included.
"""
from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import oslo_models as om
from oslo_models.data import indexed
from tests.faults import forkserver as forkserver_module
from tests.faults import launch
from tests.helpers import examples

VOCAB = 512  # the tokenizer of conftest.corpus


@pytest.fixture
def tokenizer_dir(corpus):
    return corpus["tokenizer"]


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(examples.EXAMPLES)
    import _data

    yield _data
    sys.modules.pop("_data", None)
    sys.modules.pop("_common", None)


def _corpus(path, seed: int, *, vocab: int = VOCAB, high: int = VOCAB) -> str:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, high, size=40) for _ in range(6)]
    om.data.write_token_file(path, docs, vocab_size=vocab)
    return str(path)


def _prepare(common, tokenizer_dir, prefix, output):
    args = SimpleNamespace(data=prefix, tokenizer=tokenizer_dir, model=None, output=str(output), eval_data=None,
                           text_field="text", vocab_size=VOCAB)
    return common.prepare_data(args, om.ParallelContext.single_process(), train_tokenizer=None)


def test_bad_corpora_are_refused_before_training(common, tokenizer_dir, tmp_path):
    good = _corpus(tmp_path / "good", 0)
    assert _prepare(common, tokenizer_dir, good, tmp_path / "out")[0] == good

    cases = {}
    other = _corpus(tmp_path / "other", 1)  # same sizes, other tokens
    longer = om.data.write_token_file(tmp_path / "longer", [np.arange(50)] * 7, vocab_size=VOCAB)
    assert longer
    for name, make, match in [
        ("swapped_same_size", lambda p: os.replace(other + ".bin", p + ".bin"),
         r"swapped_same_size\.bin does not belong to .*swapped_same_size\.idx"),
        ("swapped_other_size", lambda p: os.replace(str(tmp_path / "longer.bin"), p + ".bin"),
         r"swapped_other_size\.bin is \d+ bytes but its index describes \d+ uint16 tokens"),
        ("truncated_bin", lambda p: os.truncate(p + ".bin", os.path.getsize(p + ".bin") - 10),
         r"truncated_bin\.bin is \d+ bytes but its index describes"),
        ("truncated_idx", lambda p: os.truncate(p + ".idx", os.path.getsize(p + ".idx") - 8),
         r"truncated_idx\.idx is \d+ bytes, expected"),
    ]:
        prefix = _corpus(tmp_path / name, 0)
        make(prefix)
        cases[name] = (prefix, match)
    beyond = _corpus(tmp_path / "beyond", 2, vocab=1000, high=1000)  # another tokenizer's ids
    cases["beyond_vocab"] = (beyond, rf"beyond\.bin holds token id \d+ at token \d+ \(document \d+\), but the model's "
                                     rf"vocabulary has {VOCAB} ids")
    for name, (prefix, match) in cases.items():
        with pytest.raises(common.UsageError, match=r"bad corpus .*" + match):
            _prepare(common, tokenizer_dir, prefix, tmp_path / "out")

    # Negative controls: the same files without the checks are read silently.
    dataset = om.data.PackedCausalLMDataset(beyond, 16, cache=False)
    assert max(int(dataset[i]["input_ids"].max()) for i in range(len(dataset))) >= VOCAB  # handed to the model
    header, offsets = indexed.read_index(good)
    del header["bin_fingerprint"]  # an index written before fingerprints: the swapped .bin goes unnoticed
    prefix = cases["swapped_same_size"][0]
    open(prefix + ".idx", "wb").write(indexed._idx_bytes(header, np.asarray(offsets)))
    silent = om.data.MMapTokenDataset(prefix)
    assert not np.array_equal(silent.read(0, 40), om.data.MMapTokenDataset(good).read(0, 40))


def test_train_clm_refuses_a_corpus_with_ids_beyond_the_vocabulary(tokenizer_dir, forkserver, tmp_path):
    beyond = _corpus(tmp_path / "beyond", 2, vocab=1000, high=1000)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=examples.ROOT, **{forkserver_module.ENV: forkserver})
    command = [sys.executable, *launch.script("train_clm.py", "--data", beyond, "--tokenizer", tokenizer_dir,
                                              "--output", str(out), "--steps", "2", *examples.TINY)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=examples.ROOT)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "beyond.bin holds token id" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not (out / "checkpoint").exists()
