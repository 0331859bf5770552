"""Tokenize a text corpus once into ``PREFIX.bin`` + ``PREFIX.idx`` (see :mod:`oslo_models.data.indexed`).

Reading goes through Hugging Face ``datasets`` (text, jsonl/json, parquet, csv files, or a ``datasets.Dataset``
passed in), tokenizing through ``Dataset.map(batched=True, num_proc=workers)``; the write streams the tokenized
Arrow columns chunk by chunk, so peak memory is one chunk, not the corpus. ``datasets`` is imported here, lazily,
so that training machines without it can still read preprocessed corpora.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np

from .indexed import write_token_batches

_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
            ".csv": "csv"}


def _load_tokenizer(tokenizer):
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return tokenizer


def _infer_format(files: Sequence[str]) -> str:
    kinds = set()
    for f in files:
        name = f[:-3] if f.endswith(".gz") else f
        ext = Path(name).suffix.lower()
        if ext not in _FORMATS:
            raise ValueError(f"cannot tell the format of {f!r}; pass input_format= one of "
                             f"{sorted(set(_FORMATS.values()))}")
        kinds.add(_FORMATS[ext])
    if len(kinds) != 1:
        raise ValueError(f"input files mix formats {sorted(kinds)}; preprocess them separately")
    return kinds.pop()


def _load_input(source, input_format, split, cache_dir):
    import datasets

    if isinstance(source, datasets.DatasetDict):
        return source[split]
    if isinstance(source, datasets.Dataset):
        return source
    files = [os.fspath(source)] if isinstance(source, (str, os.PathLike)) else [os.fspath(s) for s in source]
    expanded: list[str] = []
    for f in files:
        if os.path.isdir(f):
            expanded += sorted(str(p) for p in Path(f).iterdir() if p.is_file() and not p.name.startswith("."))
        elif not os.path.exists(f):
            raise FileNotFoundError(f"input {f!r} not found")
        else:
            expanded.append(f)
    if not expanded:
        raise ValueError(f"empty corpus: no input files in {files}")
    fmt = input_format or _infer_format(expanded)
    return datasets.load_dataset(fmt, data_files=expanded, split="train", cache_dir=cache_dir)


def preprocess(source, output_prefix, tokenizer, *, text_field: str = "text", workers: int = 1,
               batch_size: int = 1000, append_eos: bool = True, add_special_tokens: bool = False,
               input_format: str | None = None, split: str = "train", show_progress: bool = True,
               cache_dir=None) -> dict:
    """Tokenize ``source`` and write ``output_prefix.bin`` / ``output_prefix.idx``; return the index header.

    Args:
        source: a file, folder or list of files (format from the extension unless ``input_format`` is given: one
            of ``text``, ``json``, ``parquet``, ``csv``), or a ``datasets.Dataset`` / ``DatasetDict``.
        tokenizer: a ``transformers`` tokenizer or a path/Hub name for ``AutoTokenizer``.
        text_field: the column holding the text (``text`` for plain text files).
        workers: processes for ``Dataset.map(num_proc=...)``.
        append_eos: end every document with ``eos_token_id`` (``sep_token_id`` for tokenizers without EOS, e.g.
            BERT) so packed samples keep document boundaries.
        add_special_tokens: also let the tokenizer add its per-sequence special tokens (BOS/CLS...).
        cache_dir: where ``datasets`` keeps its Arrow caches (default: its own, ``~/.cache/huggingface``).

    Raises ``ValueError`` for a missing text column, a tokenizer with neither EOS nor SEP when ``append_eos``, or an
    empty corpus (no tokens at all); ``FileNotFoundError`` for a missing input.
    """
    import datasets
    from tqdm.auto import tqdm

    tok = _load_tokenizer(tokenizer)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if append_eos and eos is None:
        raise ValueError(f"tokenizer {tok.name_or_path!r} has no eos_token_id or sep_token_id; pass "
                         f"append_eos=False (--no-eos) or set tokenizer.eos_token")
    ds = _load_input(source, input_format, split, cache_dir)
    if text_field not in ds.column_names:
        raise ValueError(f"text field {text_field!r} not in the input columns {ds.column_names}")
    if len(ds) == 0:
        raise ValueError("empty corpus: the input has no rows")

    def tokenize(batch):
        texts = [t if t is not None else "" for t in batch[text_field]]
        ids = tok(texts, add_special_tokens=add_special_tokens, return_attention_mask=False,
                  return_token_type_ids=False)["input_ids"]
        if append_eos:
            ids = [x + [eos] for x in ids]
        return {"input_ids": ids}

    if not show_progress:
        datasets.disable_progress_bars()
    try:
        tokenized = ds.map(tokenize, batched=True, batch_size=batch_size, num_proc=workers if workers > 1 else None,
                           remove_columns=ds.column_names, desc="tokenizing")
    finally:
        if not show_progress:
            datasets.enable_progress_bars()

    column = tokenized.with_format("arrow").data.column("input_ids")
    bar = tqdm(total=len(tokenized), desc=f"writing {Path(os.fspath(output_prefix)).name}.bin", unit="doc",
               disable=not show_progress)

    def batches():
        for chunk in column.chunks:  # each chunk is a pyarrow ListArray; .flatten() honours slicing
            if len(chunk) == 0:
                continue
            flat = chunk.flatten().to_numpy(zero_copy_only=False)
            lens = chunk.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            yield flat, lens

    try:
        header = write_token_batches(output_prefix, batches(), vocab_size=len(tok), tokenizer=tok,
                                     eos_token_id=eos if append_eos else tok.eos_token_id, progress=bar.update)
    finally:
        bar.close()
    return header
