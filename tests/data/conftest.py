"""Tiny tokenizers and corpora built on the spot (no Hub access)."""
from __future__ import annotations

import numpy as np
import pytest

WORDS = ("the quick brown fox jumps over lazy dog data parallel tensor pipeline memory mapped token stream "
         "sample blend mask span sentinel shard rank epoch resume corpus tokenizer vocabulary").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 30)))) for _ in range(n)]


def _fast(tokenizer_obj, path, **special):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer_obj, **special)
    tok.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory):
    """Byte-level BPE with GPT-2 style ``<|endoftext|>`` (eos = bos = pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences(200), trainer)
    return _fast(tok, tmp_path_factory.mktemp("bpe"), eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                 pad_token="<|endoftext|>")


@pytest.fixture(scope="session")
def wordpiece_tokenizer(tmp_path_factory):
    """BERT-style WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    # a small vocab so most words split into several pieces (whole-word masking has something to do)
    trainer = trainers.WordPieceTrainer(vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                                        "[MASK]"])
    tok.train_from_iterator(sentences(200), trainer)
    return _fast(tok, tmp_path_factory.mktemp("wordpiece"), pad_token="[PAD]", unk_token="[UNK]",
                 cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


@pytest.fixture(scope="session")
def t5_tokenizer(tmp_path_factory):
    """A T5-like tokenizer: <pad>=0, </s>=1, <unk>=2 and 100 <extra_id_N> sentinels at the end of the vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"])
    tok.train_from_iterator(sentences(200), trainer)
    extra = [f"<extra_id_{i}>" for i in range(100)]
    return _fast(tok, tmp_path_factory.mktemp("t5"), pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                 additional_special_tokens=extra)


def random_docs(num_docs: int, vocab: int, seed: int = 0, max_len: int = 50, min_len: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(min_len, max_len + 1))) for _ in range(num_docs)]
