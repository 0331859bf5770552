"""DistilBERT: a post-norm encoder under its own module names (``q_lin``/``k_lin``/``v_lin``/``out_lin``,
``ffn.lin1``/``lin2``, ``sa_layer_norm``, ``output_layer_norm``), no token types, learned or sinusoidal positions,
its MLM head (``vocab_transform``, ``vocab_layer_norm``, ``vocab_projector``) and the heads of the ``transformers``
contract."""
from ..family import WITHOUT_PRETRAINING, FamilyRecord, encoder_classes, family_exports

# the tiny BERT's sizes under DistilBERT's names, with sinusoidal position tables (a trainable table initialized
# with the sinusoid: only the initialization differs), no dropout
TINY_DISTILBERT = dict(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=101, max_position_embeddings=64,
                       sinusoidal_pos_embds=True, dropout=0.0, attention_dropout=0.0, qa_dropout=0.0,
                       seq_classif_dropout=0.0, pad_token_id=0)
FAMILIES = (
    FamilyRecord(model_type="distilbert", package=__name__, config="DistilBertConfig", tiny_config=TINY_DISTILBERT,
                 classes=encoder_classes("DistilBert", WITHOUT_PRETRAINING), spec="DISTILBERT_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
