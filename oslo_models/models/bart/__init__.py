"""BART: the encoder-decoder, its conditional-generation, sequence-classification and question-answering heads, and
its decoder alone as a causal LM."""
from ..family import FamilyRecord, family_exports

# The tiny BART of the tests: vocab 101 (odd: the vocab-parallel layers pad it), scaled embeddings (sqrt(d_model)),
# a non-zero final_logits_bias comes from the tests' checkpoints, GELU, no dropout.
TINY_BART = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=101,
                 max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                 scale_embedding=True, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                 forced_eos_token_id=None)
FAMILIES = (
    FamilyRecord(model_type="bart", package=__name__, config="BartConfig", tiny_config=TINY_BART,
                 classes={"base": "BartModel", "seq2seq_lm": "BartForConditionalGeneration",
                          "sequence_classification": "BartForSequenceClassification",
                          "question_answering": "BartForQuestionAnswering", "causal_lm": "BartForCausalLM"}),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={
    ".modeling_bart": ["BART_ENCODER_SPEC", "BART_DECODER_SPEC"],
    ".heads_bart": ["BartForSequenceClassification", "BartForQuestionAnswering", "BartForCausalLM"]})
