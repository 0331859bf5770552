"""ELECTRA: BERT's encoder with embeddings narrower than the hidden width (``embedding_size``, projected by
``embeddings_project``), the generator's MLM head (``ElectraForMaskedLM``), the discriminator's replaced-token head
(``ElectraForPreTraining``) and the heads of the ``transformers`` contract."""
from ..bert import TINY_ENCODER
from ..family import FamilyRecord, encoder_classes, family_exports

# the tiny BERT with embeddings half as wide as the hidden states, so ``embeddings_project`` exists (no dropout)
FAMILIES = (
    FamilyRecord(model_type="electra", package=__name__, config="ElectraConfig",
                 tiny_config={**TINY_ENCODER, "embedding_size": 16, "summary_last_dropout": 0.0},
                 classes=encoder_classes("Electra"), spec="ELECTRA_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
