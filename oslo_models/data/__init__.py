"""Pretraining data: memory-mapped token corpora, packing, blending, collators, a resumable dp sampler.

Typical use::

    python -m oslo_models.data preprocess --input corpus.jsonl --tokenizer gpt2 --output data/corpus --workers 2

    ds = om.data.PackedCausalLMDataset("data/corpus", seq_len=1024, seed=0)
    loader = om.data.build_dataloader(ds, batch_size=8, collator=om.data.CausalLMCollator(), parallel_context=ctx)

``datasets`` is only needed to preprocess (it is imported lazily there); reading needs numpy and torch.
"""
from .blended import BlendedDataset, exact_counts
from .collators import (
                        CausalLMCollator,
                        ContextParallelSplitter,
                        ImageTextCollator,
                        MLMCollator,
                        Seq2SeqCollator,
                        SequenceParallelSplitter,
                        SFTCollator,
                        T5SpanCorruptionCollator,
                        first_fit,
                        pack_documents,
                        t5_lengths,
)
from .indexed import FORMAT_VERSION, MMapTokenDataset, check_token_ids, tokenizer_identity, write_token_file
from .loader import ResumableDataLoader, build_dataloader
from .packed import PackedCausalLMDataset
from .preprocessing import preprocess
from .sampler import DistributedResumableSampler

__all__ = [
    "BlendedDataset", "CausalLMCollator", "ContextParallelSplitter", "DistributedResumableSampler", "FORMAT_VERSION",
    "ImageTextCollator", "MLMCollator", "MMapTokenDataset", "PackedCausalLMDataset", "ResumableDataLoader",
    "SFTCollator",
    "Seq2SeqCollator", "SequenceParallelSplitter", "T5SpanCorruptionCollator", "build_dataloader",
    "check_token_ids", "exact_counts", "first_fit", "pack_documents", "preprocess", "t5_lengths",
    "tokenizer_identity", "write_token_file",
]
