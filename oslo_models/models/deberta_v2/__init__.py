"""DeBERTa-v2 / v3: BERT's post-norm encoder with disentangled attention (content-to-position and
position-to-content terms over shared relative embeddings in log buckets), heads split under tensor parallelism."""
from ..family import WITHOUT_PRETRAINING, FamilyRecord, encoder_classes, family_exports

# DeBERTa-v3's shape: relative attention with both terms over 4 log buckets (shorter than the test sequences, so
# far tokens share buckets), the shared key (share_att_key), the LayerNorm on the relative embeddings, no absolute
# positions; an embedding size below the hidden size (embed_proj) and token types; vocab 101 pads under tp; weights
# drawn 10x wider than the default so the relative terms move the logits far past the tolerance (at 0.02 they
# move them by 1e-5)
TINY_DEBERTA_V2 = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       vocab_size=101, max_position_embeddings=64, type_vocab_size=2, embedding_size=24,
                       relative_attention=True, position_buckets=4, max_relative_positions=-1,
                       pos_att_type="p2c|c2p", norm_rel_ebd="layer_norm", share_att_key=True,
                       position_biased_input=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       pooler_dropout=0.0, pad_token_id=0, initializer_range=0.2)
FAMILIES = (
    FamilyRecord(model_type="deberta-v2", package=__name__, config="DebertaV2Config", tiny_config=TINY_DEBERTA_V2,
                 classes=encoder_classes("DebertaV2", WITHOUT_PRETRAINING), spec="DEBERTA_V2_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
