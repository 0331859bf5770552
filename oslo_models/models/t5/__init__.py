"""T5 (encoder-decoder, its encoder alone, and the heads of the ``transformers`` contract) and, under its own
``model_type``, mT5 (``mt5.py``: T5's classes with mT5's config class and class names)."""
from ..family import FamilyRecord, family_exports

# The tiny T5 of the tests: vocab 101 (odd: the vocab-parallel layers pad it), 8 relative-position buckets with
# max distance 16 (so the test sequences reach the log-spaced buckets), no dropout.
TINY_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=101, dropout_rate=0.0,
               relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
               pad_token_id=0, eos_token_id=1)
FAMILIES = (
    FamilyRecord(model_type="t5", package=__name__, config="T5Config",
                 tiny_config={**TINY_T5, "feed_forward_proj": "relu"},  # T5 v1.0: ReLU, tied and rescaled head
                 classes={"base": "T5Model", "seq2seq_lm": "T5ForConditionalGeneration",
                          "text_encoding": "T5EncoderModel", "sequence_classification": "T5ForSequenceClassification",
                          "token_classification": "T5ForTokenClassification",
                          "question_answering": "T5ForQuestionAnswering"}),
    # mT5 keeps MT5Config's defaults otherwise: gated-GELU feed-forward, untied head
    FamilyRecord(model_type="mt5", package=__name__, config="MT5Config", tiny_config=TINY_T5,
                 classes={"base": "MT5Model", "seq2seq_lm": "MT5ForConditionalGeneration",
                          "text_encoding": "MT5EncoderModel"}),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, others=".mt5", also={
    ".heads_t5": ["T5ForSequenceClassification", "T5ForTokenClassification", "T5ForQuestionAnswering"],
    ".parallel_plan": ["T5_PLAN"]})
