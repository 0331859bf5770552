"""preprocess(): text/jsonl/parquet/Dataset inputs, EOS per document, workers, errors, and the CLI end to end."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oslo_models.data import MMapTokenDataset, PackedCausalLMDataset, preprocess

from .conftest import sentences

REPO = Path(__file__).resolve().parents[2]


def _expected(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]


@pytest.fixture()
def jsonl(tmp_path):
    texts = sentences(60, seed=11)
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path, texts


def test_jsonl_round_trip_with_eos(jsonl, tmp_path, bpe_tokenizer):
    path, texts = jsonl
    header = preprocess(path, tmp_path / "out" / "c", bpe_tokenizer, show_progress=False,
                        cache_dir=tmp_path / "hf")
    ds = MMapTokenDataset(tmp_path / "out" / "c", tokenizer=bpe_tokenizer)
    expected = _expected(bpe_tokenizer, texts)
    assert header["num_documents"] == len(ds) == 60 and header["dtype"] == "uint16"
    assert header["tokenizer"]["name_or_path"] == bpe_tokenizer.name_or_path
    for i in (0, 17, 59):
        assert ds[i].tolist() == expected[i]
    assert ds.num_tokens == sum(map(len, expected))
    assert bpe_tokenizer.decode(ds[3][:-1]) == texts[3]


def test_workers_give_the_same_files(jsonl, tmp_path, bpe_tokenizer):
    path, _ = jsonl
    preprocess(path, tmp_path / "one", bpe_tokenizer, workers=1, batch_size=7, show_progress=False,
               cache_dir=tmp_path / "hf")
    preprocess(path, tmp_path / "two", bpe_tokenizer, workers=2, batch_size=7, show_progress=False,
               cache_dir=tmp_path / "hf2")  # a fresh cache, so the two-process map really runs
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    assert (tmp_path / "one.idx").read_bytes() == (tmp_path / "two.idx").read_bytes()


def test_text_parquet_and_dataset_inputs(tmp_path, wordpiece_tokenizer):
    import datasets

    texts = sentences(20, seed=12)
    (tmp_path / "a.txt").write_text("\n".join(texts) + "\n")
    datasets.Dataset.from_dict({"body": texts}).to_parquet(str(tmp_path / "a.parquet"))
    tok = wordpiece_tokenizer  # no EOS: documents end with [SEP]
    expected = [tok(t, add_special_tokens=False)["input_ids"] + [tok.sep_token_id] for t in texts]
    for name, src, field in (("t", tmp_path / "a.txt", "text"), ("p", tmp_path / "a.parquet", "body"),
                             ("d", datasets.Dataset.from_dict({"body": texts}), "body")):
        preprocess(src, tmp_path / name, tok, text_field=field, show_progress=False, cache_dir=tmp_path / "hf")
        ds = MMapTokenDataset(tmp_path / name)
        assert [ds[i].tolist() for i in range(len(ds))] == expected, name


def test_errors(tmp_path, jsonl, bpe_tokenizer):
    path, _ = jsonl
    kw = dict(show_progress=False, cache_dir=tmp_path / "hf")
    with pytest.raises(ValueError, match="text field 'body'"):
        preprocess(path, tmp_path / "x", bpe_tokenizer, text_field="body", **kw)
    with pytest.raises(FileNotFoundError):
        preprocess(tmp_path / "missing.jsonl", tmp_path / "x", bpe_tokenizer, **kw)
    with pytest.raises(ValueError, match="format"):
        (tmp_path / "data.xyz").write_text("hello")
        preprocess(tmp_path / "data.xyz", tmp_path / "x", bpe_tokenizer, **kw)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="empty corpus"):
        preprocess(empty, tmp_path / "x", bpe_tokenizer, append_eos=False, **kw)
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "x.idx").exists()


def test_cli_end_to_end(jsonl, tmp_path, bpe_tokenizer):
    path, texts = jsonl
    tok_dir = tmp_path / "tok"
    bpe_tokenizer.save_pretrained(tok_dir)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "oslo_models.data", "preprocess", "--input", str(path), "--text-field", "text",
           "--tokenizer", str(tok_dir), "--output", str(tmp_path / "data" / "corpus"), "--workers", "2",
           "--cache-dir", str(tmp_path / "hf")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "60 documents" in proc.stdout
    assert "writing corpus.bin" in proc.stderr  # the tqdm progress bar
    ds = PackedCausalLMDataset(tmp_path / "data" / "corpus", seq_len=16, shuffle=False, tokenizer=bpe_tokenizer)
    stream = np.concatenate([np.asarray(x) for x in _expected(bpe_tokenizer, texts)])
    np.testing.assert_array_equal(np.concatenate([ds[i]["input_ids"].numpy() for i in range(len(ds))]),
                                  stream[: len(ds) * 16])


def test_cli_user_error_is_one_line(jsonl, tmp_path, bpe_tokenizer, capsys):
    from oslo_models.data.__main__ import main

    path, _ = jsonl
    bpe_tokenizer.save_pretrained(tmp_path / "tok")
    code = main(["preprocess", "--input", str(path), "--tokenizer", str(tmp_path / "tok"), "--output",
                 str(tmp_path / "y"), "--text-field", "nope", "--quiet", "--cache-dir", str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2 and "error: text field 'nope'" in err and "Traceback" not in err
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
