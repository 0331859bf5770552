"""PackedCausalLMDataset: exact round trip, shuffling, epochs, position ids, the on-disk index cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oslo_models.data import MMapTokenDataset, PackedCausalLMDataset, write_token_file
from oslo_models.data.packed import pack_stream_order

from .conftest import random_docs


@pytest.fixture()
def corpus(tmp_path):
    docs = random_docs(120, vocab=1000, seed=7, max_len=40)
    docs[5] = np.zeros(0, dtype=np.int64)  # an empty document must be skipped, not break the packing
    write_token_file(tmp_path / "c", docs, vocab_size=1000)
    return tmp_path / "c", docs


def test_unshuffled_round_trip_is_the_file(corpus):
    prefix, docs = corpus
    stream = np.concatenate(docs)
    ds = PackedCausalLMDataset(prefix, seq_len=13, shuffle=False)
    assert len(ds) == stream.size // 13
    joined = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).numpy()
    np.testing.assert_array_equal(joined, stream[: len(ds) * 13])
    assert stream.size - joined.size < 13  # only the tail shorter than one sample is dropped
    assert ds[0]["input_ids"].dtype == torch.int64


def test_shuffled_round_trip_and_permutation(corpus):
    prefix, docs = corpus
    ds = PackedCausalLMDataset(prefix, seq_len=16, seed=3, num_epochs=2)
    stream = pack_stream_order(ds)
    # the document order is a permutation per epoch, and not the identity
    order = ds.document_order
    assert sorted(order[:120]) == list(range(120)) and sorted(order[120:]) == list(range(120))
    assert not np.array_equal(order[:120], np.arange(120)) and not np.array_equal(order[:120], order[120:])
    assert stream.size == 2 * sum(d.size for d in docs)
    # stream order: samples concatenated give the stream back exactly
    joined = np.concatenate([ds.stream_sample(j)[0] for j in range(len(ds))])
    np.testing.assert_array_equal(joined, stream[: len(ds) * 16])
    # dataset order: the same samples, shuffled
    got = {tuple(ds[i]["input_ids"].tolist()) for i in range(len(ds))}
    assert got == {tuple(ds.stream_sample(j)[0].tolist()) for j in range(len(ds))}
    assert not np.array_equal(np.asarray(ds.shuffle_idx), np.arange(len(ds)))


def test_deterministic_by_seed(corpus, tmp_path):
    prefix, _ = corpus
    a = PackedCausalLMDataset(prefix, seq_len=8, seed=11, cache=False)
    b = PackedCausalLMDataset(prefix, seq_len=8, seed=11, cache=False)
    c = PackedCausalLMDataset(prefix, seq_len=8, seed=12, cache=False)
    ids = lambda ds: torch.stack([ds[i]["input_ids"] for i in range(len(ds))])  # noqa: E731
    assert torch.equal(ids(a), ids(b))
    assert not torch.equal(ids(a), ids(c))


def test_num_samples_spans_epochs(corpus):
    prefix, docs = corpus
    total = sum(d.size for d in docs)
    n = (2 * total) // 10 + 5  # needs a third epoch
    ds = PackedCausalLMDataset(prefix, seq_len=10, num_samples=n, seed=1)
    assert len(ds) == n and ds.num_epochs == 3
    np.testing.assert_array_equal(np.concatenate([ds.stream_sample(j)[0] for j in range(n)]),
                                  pack_stream_order(ds)[: n * 10])
    with pytest.raises(IndexError):
        ds[n]


def test_document_position_ids(tmp_path):
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 30)]  # lengths 5, 3, 10
    write_token_file(tmp_path / "p", docs, vocab_size=100)
    ds = PackedCausalLMDataset(tmp_path / "p", seq_len=6, shuffle=False, document_position_ids=True)
    assert len(ds) == 3
    assert ds[0]["position_ids"].tolist() == [0, 1, 2, 3, 4, 0]
    assert ds[0]["input_ids"].tolist() == [1, 2, 3, 4, 5, 10]
    assert ds[1]["position_ids"].tolist() == [0, 1, 0, 1, 2, 3]  # restarts at the window start, then at doc 3
    assert ds[2]["position_ids"].tolist() == [0, 1, 2, 3, 4, 5]


def test_index_is_cached_and_keyed(corpus):
    prefix, _ = corpus
    a = PackedCausalLMDataset(prefix, seq_len=9, seed=5)
    files = sorted(p.name for p in prefix.parent.glob("c.packed-*.npy"))
    assert len(files) == 3
    b = PackedCausalLMDataset(prefix, seq_len=9, seed=5)
    assert isinstance(b.shuffle_idx, np.memmap)  # loaded from the cache, memory-mapped
    np.testing.assert_array_equal(a.shuffle_idx, b.shuffle_idx)
    PackedCausalLMDataset(prefix, seq_len=9, seed=6)  # another seed: another key, new files
    assert len(list(prefix.parent.glob("c.packed-*.npy"))) == 6


def test_cache_invalidated_when_corpus_changes(tmp_path):
    write_token_file(tmp_path / "c", [np.arange(50)], vocab_size=100)
    first = PackedCausalLMDataset(tmp_path / "c", seq_len=10, shuffle=False)
    assert len(first) == 5
    write_token_file(tmp_path / "c", [np.arange(30), np.arange(40)], vocab_size=100)
    second = PackedCausalLMDataset(tmp_path / "c", seq_len=10, shuffle=False)
    assert len(second) == 7
    assert second[3]["input_ids"].tolist() == list(range(10))  # a stale index would give 30..39


def test_unwritable_cache_dir_falls_back(corpus, tmp_path):
    prefix, _ = corpus
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.warns(UserWarning, match="cannot cache"):
        ds = PackedCausalLMDataset(prefix, seq_len=9, cache_dir=blocker / "sub")
    assert len(ds) > 0


def test_errors(corpus, bpe_tokenizer):
    prefix, _ = corpus
    with pytest.raises(ValueError, match="seq_len"):
        PackedCausalLMDataset(prefix, seq_len=0)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        PackedCausalLMDataset(prefix, seq_len=10**7)
    with pytest.raises(ValueError, match="not both"):
        PackedCausalLMDataset(prefix, seq_len=4, num_samples=3, num_epochs=1)
    with pytest.raises(ValueError, match="records no tokenizer"):
        PackedCausalLMDataset(prefix, seq_len=4, tokenizer=bpe_tokenizer)
    with pytest.raises(FileNotFoundError):
        PackedCausalLMDataset(prefix.parent / "missing", seq_len=4)


def test_accepts_open_dataset(corpus):
    prefix, _ = corpus
    ds = PackedCausalLMDataset(MMapTokenDataset(prefix), seq_len=7, shuffle=False)
    np.testing.assert_array_equal(ds[2]["input_ids"].numpy(), ds.data.read(14, 7))
