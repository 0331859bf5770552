"""Collators: lists of samples -> dicts of ``int64`` tensors with Hugging Face names."""
from .causal import CausalLMCollator, Seq2SeqCollator, shift_right
from .context_parallel import ContextParallelSplitter
from .mlm import MLMCollator, word_start_table
from .splitter import SequenceParallelSplitter
from .t5 import T5SpanCorruptionCollator, random_spans_noise_mask, t5_lengths

__all__ = ["CausalLMCollator", "ContextParallelSplitter", "MLMCollator", "Seq2SeqCollator", "SequenceParallelSplitter",
           "T5SpanCorruptionCollator", "random_spans_noise_mask", "shift_right", "t5_lengths", "word_start_table"]
