"""The on-disk token format (``PREFIX.bin`` + ``PREFIX.idx``) and :class:`MMapTokenDataset`.

``PREFIX.bin`` is the flat token stream of every document, one after the other, as little-endian ``uint16``
(when every id fits, i.e. ``vocab_size <= 65536``) or ``uint32``. Nothing else is in it, so it can be read with
``numpy.memmap`` and any slice costs O(1).

``PREFIX.idx`` describes it::

    8 bytes   magic b"OSLOTOK\\0"
    4 bytes   format version (uint32 LE)
    4 bytes   header length H (uint32 LE)
    H bytes   JSON header: dtype, vocab_size, num_documents, num_tokens, eos_token_id, tokenizer identity
    padding   to an 8-byte boundary
    8*(D+1)   document offsets (int64 LE, in tokens): document d is tokens[offsets[d]:offsets[d+1]]

The offsets are memory-mapped too, so opening a corpus with millions of documents reads a few hundred bytes.
Both files are written atomically (temp file in the same folder, fsync, ``os.replace``), ``.bin`` first, so a crash
leaves either the old pair, or a new ``.bin`` that the old ``.idx`` reports as the wrong size (``ValueError``).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from ..utils.files import atomic_write_file

MAGIC = b"OSLOTOK\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
# A page fault on a file mapping maps more than the page read: fault-around (64 KiB by default) and, on recent
# kernels, whole large page-cache folios (up to 2 MiB). On the benchmark box (kernel 6.18) counting 64 KiB per read
# let RSS grow by 340 MB over a random pass of a 1 GB corpus and 512 KiB by 169 MB, so count a whole 2 MiB folio.
_FAULT_AROUND_BYTES = 2 * 1024 * 1024
_FINGERPRINT_BYTES = 64 * 1024
_SCAN_TOKENS = 16 * 1024 * 1024  # tokens per chunk when checking ids (32-64 MiB of the memory map at a time)


def tokenizer_identity(tokenizer) -> dict:
    """``{"name_or_path", "vocab_hash"}`` for a Hugging Face tokenizer.

    The hash covers the full vocabulary (added tokens included), so two tokenizers that map any string to different
    ids never share it; the name is informational (a moved folder keeps the same hash).
    """
    vocab = tokenizer.get_vocab()
    blob = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode("utf-8")
    return {
        "name_or_path": str(getattr(tokenizer, "name_or_path", "") or ""),
        "vocab_hash": hashlib.sha256(blob).hexdigest(),
    }


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id in ``[0, vocab_size)`` fits, else ``uint32``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def bin_path(prefix) -> Path:
    return Path(f"{os.fspath(prefix)}.bin")


def idx_path(prefix) -> Path:
    return Path(f"{os.fspath(prefix)}.idx")


def _idx_bytes(header: dict, offsets: np.ndarray) -> bytes:
    meta = json.dumps(header, sort_keys=True).encode("utf-8")
    start = _PREFIX.size + len(meta)
    pad = (-start) % 8
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(meta)) + meta + b"\0" * pad + offsets.astype("<i8").tobytes()


def write_token_file(prefix, documents: Iterable, *, vocab_size: int, tokenizer=None, eos_token_id=None) -> dict:
    """Write ``documents`` (an iterable of 1-D integer sequences) as ``prefix.bin`` + ``prefix.idx``.

    Returns the header written. Raises ``ValueError`` for an empty corpus (no tokens at all) or an id outside
    ``[0, vocab_size)``; in both cases no file is created or replaced.
    """
    def batches():
        chunk: list[np.ndarray] = []
        for doc in documents:
            chunk.append(np.asarray(doc, dtype=np.int64).reshape(-1))
            if len(chunk) == 1024:
                yield _flatten(chunk)
                chunk = []
        if chunk:
            yield _flatten(chunk)

    return write_token_batches(prefix, batches(), vocab_size=vocab_size, tokenizer=tokenizer,
                               eos_token_id=eos_token_id)


def _flatten(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((d.size for d in docs), dtype=np.int64, count=len(docs))
    return (np.concatenate(docs) if docs else np.zeros(0, np.int64)), lengths


def write_token_batches(prefix, batches: Iterable[tuple[np.ndarray, np.ndarray]], *, vocab_size: int,
                        tokenizer=None, eos_token_id=None, progress=None) -> dict:
    """Like :func:`write_token_file`, fed with ``(flat_tokens, doc_lengths)`` batches (the fast path).

    ``flat_tokens`` is the 1-D concatenation of a batch of documents and ``doc_lengths`` their int lengths.
    ``progress``, if given, is called with the number of documents of each batch once it is written.
    """
    dtype = token_dtype(vocab_size)
    out_dtype = dtype.newbyteorder("<")
    lengths: list[np.ndarray] = []
    bpath = bin_path(prefix)

    def write_bin(f):
        for flat, lens in batches:
            flat, lens = np.asarray(flat).reshape(-1), np.asarray(lens, dtype=np.int64).reshape(-1)
            if int(lens.sum()) != flat.size:
                raise ValueError(f"batch lengths sum to {int(lens.sum())} but it holds {flat.size} tokens")
            if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
                bad = int(flat.max()) if int(flat.max()) >= vocab_size else int(flat.min())
                raise ValueError(f"token id {bad} is outside [0, {vocab_size})")
            f.write(flat.astype(out_dtype, copy=False).tobytes())
            lengths.append(lens)
            if progress is not None:
                progress(lens.size)
        if not lengths or sum(int(x.sum()) for x in lengths) == 0:
            raise ValueError(f"empty corpus: no tokens to write to {bpath}")

    atomic_write_file(bpath, write_bin)
    fingerprint = bin_fingerprint(bpath)
    all_lengths = np.concatenate(lengths)
    offsets = np.zeros(all_lengths.size + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=offsets[1:])
    header = {
        "dtype": dtype.name,
        "vocab_size": int(vocab_size),
        "num_documents": int(all_lengths.size),
        "num_tokens": int(offsets[-1]),
        "eos_token_id": None if eos_token_id is None else int(eos_token_id),
        "tokenizer": tokenizer_identity(tokenizer) if tokenizer is not None else None,
        "bin_fingerprint": fingerprint,
    }
    atomic_write_file(idx_path(prefix), lambda f: f.write(_idx_bytes(header, offsets)))
    return header


def bin_fingerprint(path) -> str:
    """SHA-256 of a ``.bin``'s size and its first and last 64 KiB: cheap to check on every open, and different for
    a ``.bin`` of another corpus of the same size (its index would cut it at the wrong places)."""
    sha = hashlib.sha256()
    size = os.path.getsize(path)
    sha.update(str(size).encode())
    with open(path, "rb") as handle:
        sha.update(handle.read(_FINGERPRINT_BYTES))
        handle.seek(max(0, size - _FINGERPRINT_BYTES))
        sha.update(handle.read(_FINGERPRINT_BYTES))
    return sha.hexdigest()


def read_index(prefix) -> tuple[dict, np.ndarray]:
    """Return ``(header, offsets)`` of ``prefix.idx``; ``offsets`` is a read-only int64 memmap of D+1 entries."""
    path = idx_path(prefix)
    if not path.is_file():
        raise FileNotFoundError(f"token index {path} not found (run `python -m oslo_models.data preprocess`)")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_PREFIX.size)
        if len(head) < _PREFIX.size:
            raise ValueError(f"{path} is truncated ({size} bytes): not an oslo-models token index")
        magic, version, meta_len = _PREFIX.unpack(head)
        if magic != MAGIC:
            raise ValueError(f"{path} is not an oslo-models token index (bad magic {magic!r})")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path} has format version {version}, this oslo-models reads version "
                             f"{FORMAT_VERSION}; re-run preprocess to rebuild it")
        try:
            header = json.loads(f.read(meta_len).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} has a corrupt header: {err}") from None
    start = _PREFIX.size + meta_len
    start += (-start) % 8
    num_docs = int(header["num_documents"])
    if size != start + 8 * (num_docs + 1):
        raise ValueError(f"{path} is {size} bytes, expected {start + 8 * (num_docs + 1)} for {num_docs} documents")
    offsets = np.memmap(path, dtype="<i8", mode="r", offset=start, shape=(num_docs + 1,))
    if int(offsets[-1]) != int(header["num_tokens"]):
        raise ValueError(f"{path} is corrupt: offsets end at {int(offsets[-1])}, header says "
                         f"{header['num_tokens']} tokens")
    steps = np.diff(np.asarray(offsets))
    if int(offsets[0]) != 0 or (steps.size and int(steps.min()) < 0):
        bad = 0 if int(offsets[0]) != 0 else int(np.argmax(steps < 0)) + 1
        raise ValueError(f"{path} is corrupt: document offsets must start at 0 and never decrease (offset {bad} "
                         f"is {int(offsets[bad])}, after {int(offsets[bad - 1]) if bad else 'nothing'})")
    return header, offsets


class MMapTokenDataset:
    """Documents of a ``.bin/.idx`` corpus, read through ``numpy.memmap`` with nothing loaded up front.

    ``ds[d]`` is document ``d`` as a read-only 1-D ``uint16``/``uint32`` array view (no copy); ``ds.tokens`` is the
    whole stream, ``ds.doc_offsets`` the int64 ``[D+1]`` offsets. ``ds.read(start, length)`` copies a token range of
    the stream into an ``int64`` array.

    A memory map keeps every page it touched resident in the process (RSS), so reading a whole 1 GB corpus at random
    would grow RSS by 1 GB. Every ``release_every_bytes`` of reads the touched pages are dropped from this process
    with ``madvise(MADV_DONTNEED)``; they stay in the kernel page cache, so re-reading them costs a minor fault, not
    disk I/O. Set it to ``None`` to keep pages mapped.

    Errors: ``FileNotFoundError`` when a file is missing; ``ValueError`` for a truncated/oversized ``.bin``, an
    index of another format version, an empty corpus, or (when ``tokenizer`` is given) a tokenizer whose vocabulary
    differs from the one the corpus was written with.
    """

    def __init__(self, prefix, *, tokenizer=None, release_every_bytes: int | None = 64 * 1024 * 1024):
        self.prefix = os.fspath(prefix)
        self.header, self.doc_offsets = read_index(prefix)
        bpath = bin_path(prefix)
        if not bpath.is_file():
            raise FileNotFoundError(f"token file {bpath} not found (its index {idx_path(prefix)} exists)")
        self.dtype = np.dtype(self.header["dtype"]).newbyteorder("<")
        self.num_tokens = int(self.header["num_tokens"])
        self.vocab_size = int(self.header["vocab_size"])
        self.eos_token_id = self.header.get("eos_token_id")
        expected = self.num_tokens * self.dtype.itemsize
        actual = bpath.stat().st_size
        if actual != expected:
            raise ValueError(f"{bpath} is {actual} bytes but its index describes {self.num_tokens} "
                             f"{self.dtype.name} tokens ({expected} bytes): truncated or from another run")
        if self.num_tokens == 0 or len(self) == 0:
            raise ValueError(f"empty corpus: {bpath} holds no tokens")
        recorded = self.header.get("bin_fingerprint")
        if recorded is not None and bin_fingerprint(bpath) != recorded:
            raise ValueError(f"{bpath} does not belong to {idx_path(prefix)}: same size, but not the tokens the index "
                             "was written for (another corpus, or the file was changed); re-run preprocess")
        if tokenizer is not None:
            self.check_tokenizer(tokenizer)
        self.tokens = np.memmap(bpath, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        # plain-ndarray views of the same maps: slicing them skips np.memmap's Python-level __getitem__ and
        # __array_finalize__, which are most of the cost of reading one sample
        self._tokens = self.tokens.view(np.ndarray)
        self._offsets = self.doc_offsets.view(np.ndarray)
        self.release_every_bytes = release_every_bytes
        self._touched = 0

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ``ValueError`` unless ``tokenizer`` has the vocabulary this corpus was written with."""
        stored = self.header.get("tokenizer")
        if stored is None:
            raise ValueError(f"{self.prefix}.idx records no tokenizer; cannot check it against {tokenizer!r}")
        ident = tokenizer_identity(tokenizer)
        if ident["vocab_hash"] != stored["vocab_hash"]:
            raise ValueError(f"tokenizer mismatch: {self.prefix} was tokenized with {stored['name_or_path']!r} "
                             f"(vocab hash {stored['vocab_hash'][:12]}), got {ident['name_or_path']!r} "
                             f"(vocab hash {ident['vocab_hash'][:12]})")

    def check_ids(self, vocab_size: int, *, start: int = 0, stop: int | None = None) -> None:
        """Raise ``ValueError`` naming the file, the id and where it is when a token in ``tokens[start:stop]``
        is ``>= vocab_size`` (it would index past the embedding: an error on one rank, silently masked to a zero
        embedding by a vocabulary-parallel one). Reads the range once, in chunks."""
        stop = self.num_tokens if stop is None else min(stop, self.num_tokens)
        for begin in range(start, stop, _SCAN_TOKENS):
            chunk = self._tokens[begin:min(stop, begin + _SCAN_TOKENS)]
            if chunk.size and int(chunk.max()) >= vocab_size:
                position = begin + int(np.argmax(chunk >= vocab_size))
                document = int(np.searchsorted(self._offsets, position, side="right")) - 1
                raise ValueError(f"{bin_path(self.prefix)} holds token id {int(self._tokens[position])} at token "
                                 f"{position} (document {document}), but the model's vocabulary has {vocab_size} "
                                 f"ids (0..{vocab_size - 1}): written with another tokenizer, or corrupt")
            self.release_memory()

    def __len__(self) -> int:
        return self.doc_offsets.shape[0] - 1

    def document_lengths(self) -> np.ndarray:
        """int64 ``[D]`` token count of every document (reads the whole offsets array)."""
        return np.diff(np.asarray(self.doc_offsets))

    def __getitem__(self, d: int) -> np.ndarray:
        if not -len(self) <= d < len(self):
            raise IndexError(f"document {d} out of range for {len(self)} documents")
        d %= len(self)
        start, end = int(self._offsets[d]), int(self._offsets[d + 1])
        self._account(end - start)
        return self._tokens[start:end]

    def read(self, start: int, length: int) -> np.ndarray:
        """Copy ``tokens[start:start+length]`` into a new ``int64`` array."""
        out = self._tokens[start:start + length].astype(np.int64)
        self._account(length)
        return out

    def _account(self, num_tokens: int) -> None:
        self._touched += num_tokens * self.dtype.itemsize + _FAULT_AROUND_BYTES
        if self.release_every_bytes is not None and self._touched >= self.release_every_bytes:
            self.release_memory()

    def release_memory(self) -> None:
        """Drop this process's mapping of the pages read so far (they stay in the page cache)."""
        self._touched = 0
        mm = getattr(self.tokens, "_mmap", None)  # numpy keeps the mmap.mmap object there
        if mm is not None and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED)

    def __getstate__(self):
        # DataLoader workers / spawn pickle the dataset: send the path, re-open the maps on the other side.
        return {"prefix": self.prefix, "release_every_bytes": self.release_every_bytes}

    def __setstate__(self, state):
        self.__init__(state["prefix"], release_every_bytes=state["release_every_bytes"])

    def __repr__(self) -> str:
        return (f"MMapTokenDataset({self.prefix!r}, documents={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype.name}, vocab_size={self.vocab_size})")


def check_token_ids(prefix, vocab_size: int, *, parallel_context=None) -> None:
    """Before training: open ``prefix`` (``.bin``/``.idx`` sizes, offsets, fingerprint) and check that every id
    is below ``vocab_size``. With ``parallel_context`` every rank reads ``1/world`` of the tokens and every rank
    raises the same ``ValueError``/``FileNotFoundError`` naming the file (one ``all_gather_object``)."""
    from ..distributed.agreement import agree_on_failure

    world, rank = (parallel_context.world_size, parallel_context.rank) if parallel_context is not None else (1, 0)
    error = None
    try:
        data = MMapTokenDataset(prefix, release_every_bytes=None)
        total = data.num_tokens
        data.check_ids(vocab_size, start=total * rank // world, stop=total * (rank + 1) // world)
    except (ValueError, OSError) as caught:
        error = caught
    if parallel_context is None:
        if error is not None:
            raise error
        return
    agree_on_failure(parallel_context, error, what=f"checking the corpus {os.fspath(prefix)}")
