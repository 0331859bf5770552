"""GPT-J: parallel residual with one shared ``ln_1``, interleaved partial rotary (``rotary_dim``), no attention
biases, a biased LM head, on the shared stack."""
from ..family import FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="gptj", package=__name__, config="GPTJConfig",
        classes=decoder_classes("GPTJ", ("base", "causal_lm", "sequence_classification", "question_answering")),
        # rotary_dim 4 of the 8 dims of each head, rotated in interleaved pairs; biased lm_head; no dropout
        tiny_config=dict(n_embd=64, n_inner=96, n_layer=2, n_head=8, vocab_size=101, n_positions=64, rotary_dim=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2),
        spec="GPTJ_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES, also={".modeling_gptj": ["GPTJBlock"]})
