"""ModernBERT: a pre-norm encoder with GeGLU (fused ``Wi``), alternating global / local (sliding-window) bidirectional
attention with two rotary bases, no biases and a final norm, on the shared stack."""
from ..family import WITHOUT_PRETRAINING, FamilyRecord, encoder_classes, family_exports

# 3 layers with a global one every 2nd (global, local, global); a local window of 2 tokens each side
# (local_attention=4) is shorter than every test sequence; the two rotary bases differ; vocab 101 pads under tp;
# weights drawn 10x wider than the default, so the attention pattern moves the logits far past the tolerance (at
# 0.02 one rotary base for both kinds of layer moves them by 2e-6)
TINY_MODERNBERT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                       vocab_size=101, max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
                       global_rope_theta=160000.0, local_rope_theta=10000.0, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, cls_token_id=1, sep_token_id=2, embedding_dropout=0.0, mlp_dropout=0.0,
                       attention_dropout=0.0, classifier_dropout=0.0, initializer_range=0.2)
FAMILIES = (
    FamilyRecord(model_type="modernbert", package=__name__, config="ModernBertConfig", tiny_config=TINY_MODERNBERT,
                 classes=encoder_classes("ModernBert", WITHOUT_PRETRAINING), spec="MODERNBERT_SPEC"),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
