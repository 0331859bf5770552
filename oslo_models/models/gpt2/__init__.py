"""GPT-2: the decoder, its LM head and the heads of the ``transformers`` contract."""
from ..family import FamilyRecord, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="gpt2", package=__name__, config="GPT2Config",
        classes={"base": "GPT2Model", "causal_lm": "GPT2LMHeadModel",
                 "sequence_classification": "GPT2ForSequenceClassification",
                 "token_classification": "GPT2ForTokenClassification",
                 "question_answering": "GPT2ForQuestionAnswering"},
        # vocab 101: not divisible by 2 or 4, so the vocab-parallel layers pad it; no dropout (parity tests)
        tiny_config=dict(n_embd=32, n_layer=2, n_head=4, vocab_size=101, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0),
        spec="GPT2_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
