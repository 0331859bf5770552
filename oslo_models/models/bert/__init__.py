"""BERT: the encoder, its masked-LM / pre-training heads and the heads of the ``transformers`` contract."""
from ..family import FamilyRecord, family_exports

# the tiny BERT of the tests: vocab 101 is not divisible by 2 or 4, so the vocab-parallel layers pad it
TINY_ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=101,
                    max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, pad_token_id=0)
FAMILIES = (
    FamilyRecord(model_type="bert", package=__name__, config="BertConfig", tiny_config=TINY_ENCODER, classes={
        "base": "BertModel", "masked_lm": "BertForMaskedLM", "pretraining": "BertForPreTraining",
        "sequence_classification": "BertForSequenceClassification",
        "token_classification": "BertForTokenClassification", "question_answering": "BertForQuestionAnswering",
        "causal_lm": "BertLMHeadModel", "multiple_choice": "BertForMultipleChoice",
        "next_sentence_prediction": "BertForNextSentencePrediction"}, spec="BERT_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
