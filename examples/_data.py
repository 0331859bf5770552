"""Corpus and tokenizer for the example scripts: where the tokenizer comes from, tokenizing a text file into a
``.bin/.idx`` pair on rank 0 while the others wait, and the checks that refuse a corpus or tokenizer that does not
fit the model (before any training step). Not a public API (see ``_common.py``)."""
from __future__ import annotations

import os

import transformers

import oslo_models as om
from _common import HERE, UsageError

BUILTIN_CORPUS = os.path.join(HERE, "data", "public_domain.txt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def tokenizer_source(args) -> str | None:
    """Where the tokenizer comes from: ``--tokenizer``, else ``--model``; ``None``: train one into OUTPUT."""
    if args.tokenizer:
        return args.tokenizer
    if args.model and os.path.isdir(args.model) and not _has_tokenizer_files(args.model):
        raise UsageError(f"--model {args.model} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...): "
                         f"pass --tokenizer FOLDER_OR_HUB_ID")
    return args.model


def check_tokenizer(args, tokenizer) -> None:
    """Refuse a tokenizer whose ids do not fit the model's embedding (``--model``'s config vocab_size)."""
    if len(tokenizer) <= 1:
        raise UsageError(f"the tokenizer from {args.tokenizer or args.model} is empty (vocabulary {len(tokenizer)})")
    if args.model:
        vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
        if len(tokenizer) > vocab:
            raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but {args.model} embeds {vocab}: ids past "
                             f"{vocab - 1} would index outside the embedding; pass the model's own --tokenizer")


def _tokenize(args, source: str, prefix: str, tokenizer_dir: str) -> str:
    """Rank 0 only: a ``.bin/.idx`` prefix for ``source`` (itself when it is one, else tokenized to ``prefix``)."""
    if os.path.isfile(str(source) + ".idx"):
        return source
    if not os.path.isfile(prefix + ".idx"):
        om.data.preprocess(source, prefix, tokenizer_dir, text_field=args.text_field, show_progress=False)
    return prefix


def prepare_data(args, context, train_tokenizer) -> tuple[str, str | None, transformers.PreTrainedTokenizerBase]:
    """``(train prefix, eval prefix or None, tokenizer)``; rank 0 builds what is missing while the others wait.

    ``train_tokenizer(text_file, folder, vocab_size)`` writes a tokenizer folder when neither ``--tokenizer`` nor
    ``--model`` gives one.
    """
    data = args.data or BUILTIN_CORPUS
    tokenizer_dir = tokenizer_source(args) or os.path.join(args.output, "tokenizer")
    is_prefix = os.path.isfile(str(data) + ".idx")
    prefix = data if is_prefix else os.path.join(args.output, "corpus")
    eval_prefix = None
    if args.eval_data:
        eval_prefix = args.eval_data if os.path.isfile(args.eval_data + ".idx") else os.path.join(args.output,
                                                                                                  "eval_corpus")
    train_one = tokenizer_dir == os.path.join(args.output, "tokenizer") and not _has_tokenizer_files(tokenizer_dir)
    if train_one and is_prefix:  # on every rank alike, before the others would wait for rank 0
        raise UsageError("--data is a token file: pass --tokenizer (or --model) for its tokenizer")
    if context.is_main_process:
        os.makedirs(args.output, exist_ok=True)
        if train_one:
            train_tokenizer(data, tokenizer_dir, args.vocab_size)
        _tokenize(args, data, prefix, tokenizer_dir)
        if args.eval_data:
            _tokenize(args, args.eval_data, eval_prefix, tokenizer_dir)
    context.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    check_tokenizer(args, tokenizer)
    vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size if args.model else len(tokenizer)
    for corpus in filter(None, (prefix, eval_prefix)):
        try:  # before training: files that do not match, truncated ones, ids past the embedding (every rank alike)
            om.data.check_token_ids(corpus, vocab, parallel_context=context)
        except (ValueError, OSError) as error:
            raise UsageError(f"bad corpus {corpus}: {error}") from None
    check_corpus(tokenizer, prefix, eval_prefix)
    return prefix, eval_prefix, tokenizer


def check_corpus(tokenizer, *prefixes) -> None:
    """Refuse a token file written with another vocabulary (a ``--data`` prefix, or OUTPUT/corpus left by a run
    with another tokenizer): its ids would mean other tokens."""
    for prefix in filter(None, prefixes):
        corpus = om.data.MMapTokenDataset(prefix)
        if corpus.header.get("tokenizer") is None:  # written without a tokenizer record: nothing to compare
            continue
        try:
            corpus.check_tokenizer(tokenizer)
        except ValueError as error:
            raise UsageError(f"{error}. Pass the corpus' own --tokenizer, or delete {prefix}.bin/.idx (files in "
                             f"--output are rebuilt)") from None
