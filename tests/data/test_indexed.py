"""The .bin/.idx format and MMapTokenDataset: round trip, dtype choice, atomic writes, corrupt inputs."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from oslo_models.data import MMapTokenDataset, indexed, write_token_file

from .conftest import random_docs


def test_documents_round_trip_uint16(tmp_path):
    docs = random_docs(300, vocab=5000, seed=1)
    header = write_token_file(tmp_path / "c", docs, vocab_size=5000, eos_token_id=7)
    ds = MMapTokenDataset(tmp_path / "c")
    assert header["dtype"] == "uint16" and ds.dtype.itemsize == 2
    assert os.path.getsize(tmp_path / "c.bin") == 2 * sum(d.size for d in docs)
    assert len(ds) == 300 and ds.num_tokens == sum(d.size for d in docs) and ds.eos_token_id == 7
    for i in (0, 1, 150, 299, -1):
        np.testing.assert_array_equal(ds[i], docs[i])
    np.testing.assert_array_equal(np.asarray(ds.tokens), np.concatenate(docs))
    np.testing.assert_array_equal(ds.document_lengths(), [d.size for d in docs])
    np.testing.assert_array_equal(ds.read(5, 40), np.concatenate(docs)[5:45])
    with pytest.raises(IndexError):
        ds[300]


def test_large_vocab_uses_uint32(tmp_path):
    docs = [np.array([0, 65535, 65536, 100_000]), np.array([3])]
    write_token_file(tmp_path / "c", docs, vocab_size=100_001)
    ds = MMapTokenDataset(tmp_path / "c")
    assert ds.dtype.name == "uint32"
    np.testing.assert_array_equal(ds[0], docs[0])  # 65536 and 100000 would wrap in uint16
    assert indexed.token_dtype(65536) == np.uint16 and indexed.token_dtype(65537) == np.uint32


def test_id_outside_vocab_rejected(tmp_path):
    with pytest.raises(ValueError, match="outside"):
        write_token_file(tmp_path / "c", [np.array([1, 2, 300])], vocab_size=300)
    assert not (tmp_path / "c.bin").exists() and not (tmp_path / "c.idx").exists()


def test_empty_corpus_rejected_and_nothing_written(tmp_path):
    with pytest.raises(ValueError, match="empty corpus"):
        write_token_file(tmp_path / "c", [], vocab_size=10)
    with pytest.raises(ValueError, match="empty corpus"):
        write_token_file(tmp_path / "c", [np.array([], dtype=np.int64)] * 3, vocab_size=10)
    assert list(tmp_path.iterdir()) == []  # no temp files left behind either


def test_empty_corpus_file_rejected_on_read(tmp_path):
    write_token_file(tmp_path / "c", [np.array([1])], vocab_size=10)
    # forge a valid-looking index of zero documents / tokens
    header = {"dtype": "uint16", "vocab_size": 10, "num_documents": 0, "num_tokens": 0, "eos_token_id": None,
              "tokenizer": None}
    (tmp_path / "c.idx").write_bytes(indexed._idx_bytes(header, np.zeros(1, np.int64)))
    (tmp_path / "c.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty corpus"):
        MMapTokenDataset(tmp_path / "c")


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"c\.idx"):
        MMapTokenDataset(tmp_path / "c")
    write_token_file(tmp_path / "c", random_docs(5, 100), vocab_size=100)
    os.remove(tmp_path / "c.bin")
    with pytest.raises(FileNotFoundError, match=r"c\.bin"):
        MMapTokenDataset(tmp_path / "c")


def test_truncated_or_foreign_bin(tmp_path):
    write_token_file(tmp_path / "c", random_docs(20, 100), vocab_size=100)
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-2])
    with pytest.raises(ValueError, match="truncated"):
        MMapTokenDataset(tmp_path / "c")
    (tmp_path / "c.bin").write_bytes(data + b"\0\0")
    with pytest.raises(ValueError, match="bytes but its index"):
        MMapTokenDataset(tmp_path / "c")


def test_other_format_version_and_bad_magic(tmp_path):
    write_token_file(tmp_path / "c", random_docs(5, 100), vocab_size=100)
    raw = bytearray((tmp_path / "c.idx").read_bytes())
    raw[8:12] = struct.pack("<I", indexed.FORMAT_VERSION + 1)
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="format version"):
        MMapTokenDataset(tmp_path / "c")
    raw[0:8] = b"MMIDIDX\0"
    (tmp_path / "c.idx").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="bad magic"):
        MMapTokenDataset(tmp_path / "c")
    (tmp_path / "c.idx").write_bytes(bytes(raw[:5]))
    with pytest.raises(ValueError, match="truncated"):
        MMapTokenDataset(tmp_path / "c")


def test_truncated_idx(tmp_path):
    write_token_file(tmp_path / "c", random_docs(5, 100), vocab_size=100)
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(raw[:-8])
    with pytest.raises(ValueError, match="expected"):
        MMapTokenDataset(tmp_path / "c")


def test_tokenizer_mismatch(tmp_path, bpe_tokenizer, wordpiece_tokenizer):
    write_token_file(tmp_path / "c", random_docs(5, 100), vocab_size=len(bpe_tokenizer), tokenizer=bpe_tokenizer)
    MMapTokenDataset(tmp_path / "c", tokenizer=bpe_tokenizer)  # same vocabulary: fine
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        MMapTokenDataset(tmp_path / "c", tokenizer=wordpiece_tokenizer)
    write_token_file(tmp_path / "d", random_docs(5, 100), vocab_size=100)
    with pytest.raises(ValueError, match="records no tokenizer"):
        MMapTokenDataset(tmp_path / "d", tokenizer=bpe_tokenizer)


def test_failed_rewrite_keeps_previous_files(tmp_path, monkeypatch):
    old = random_docs(10, 100, seed=1)
    write_token_file(tmp_path / "c", old, vocab_size=100)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(indexed.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        write_token_file(tmp_path / "c", random_docs(10, 100, seed=2), vocab_size=100)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old pair intact, no temp files
    monkeypatch.undo()
    np.testing.assert_array_equal(MMapTokenDataset(tmp_path / "c")[3], old[3])


def test_release_memory_keeps_reading_correct(tmp_path):
    docs = random_docs(200, 1000, seed=3)
    write_token_file(tmp_path / "c", docs, vocab_size=1000)
    ds = MMapTokenDataset(tmp_path / "c", release_every_bytes=1)  # release after every read
    for i in range(0, 200, 7):
        np.testing.assert_array_equal(ds[i], docs[i])
    assert ds._touched == 0


def test_pickle_reopens(tmp_path):
    import pickle

    docs = random_docs(10, 100)
    write_token_file(tmp_path / "c", docs, vocab_size=100)
    ds = pickle.loads(pickle.dumps(MMapTokenDataset(tmp_path / "c")))
    np.testing.assert_array_equal(ds[4], docs[4])
