"""ALBERT: factorized embeddings (``embedding_size`` -> hidden by ``encoder.embedding_hidden_mapping_in``) and
``num_hidden_groups`` layer groups whose parameters are shared across the ``num_hidden_layers`` layers, the MLM
and sentence-order heads and the heads of the ``transformers`` contract."""
from ..bert import TINY_ENCODER
from ..family import FamilyRecord, encoder_classes, family_exports

# the tiny BERT with 16-wide embeddings and 4 layers run by 2 groups of 2 inner layers (each group's parameters
# shared by 2 layers: layers 0-1 run group 0, layers 2-3 group 1), no dropout
FAMILIES = (
    FamilyRecord(model_type="albert", package=__name__, config="AlbertConfig",
                 tiny_config={**TINY_ENCODER, "embedding_size": 16, "num_hidden_layers": 4, "num_hidden_groups": 2,
                              "inner_group_num": 2, "classifier_dropout_prob": 0.0, "hidden_act": "gelu_new"},
                 classes=encoder_classes("Albert"), spec="ALBERT_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
