"""Collators: lists of samples -> dicts of ``int64`` tensors with Hugging Face names."""
from .causal import CausalLMCollator, Seq2SeqCollator, shift_right
from .context_parallel import ContextParallelSplitter
from .image_text import ImageTextCollator
from .mlm import MLMCollator, word_start_table
from .packing import first_fit, pack_documents
from .sft import SFTCollator
from .splitter import SequenceParallelSplitter
from .t5 import T5SpanCorruptionCollator, random_spans_noise_mask, t5_lengths

__all__ = ["CausalLMCollator", "ContextParallelSplitter", "ImageTextCollator", "MLMCollator", "SFTCollator",
           "Seq2SeqCollator",
           "SequenceParallelSplitter", "T5SpanCorruptionCollator", "first_fit", "pack_documents",
           "random_spans_noise_mask", "shift_right", "t5_lengths", "word_start_table"]
