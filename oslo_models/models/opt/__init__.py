"""OPT: learned positions with offset 2 counted from the attention mask, pre- or post-norm blocks
(``do_layer_norm_before``), ``word_embed_proj_dim`` projections, the base model under ``decoder``, on the shared
stack."""
from ..family import FamilyRecord, decoder_classes, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="opt", package=__name__, config="OPTConfig",
        classes=decoder_classes("OPT", ("base", "causal_lm", "sequence_classification", "question_answering")),
        # pre-norm with word_embed_proj_dim 32 != hidden 64 (project_in / project_out, a 32-wide tied head);
        # post-norm is in tests/models/test_decoder_families_alibi.py. No dropout (parity tests).
        tiny_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, ffn_dim=96,
                         word_embed_proj_dim=32, vocab_size=101, max_position_embeddings=64, dropout=0.0,
                         attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2),
        spec="OPT_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
