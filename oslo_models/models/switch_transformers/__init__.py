"""Switch Transformers: T5 with sparse (mixture-of-experts) feed-forwards, on the T5 pieces."""
from ..family import FamilyRecord, family_exports

FAMILIES = (
    FamilyRecord(
        model_type="switch_transformers", package=__name__, config="SwitchTransformersConfig",
        classes={"base": "SwitchTransformersModel", "seq2seq_lm": "SwitchTransformersForConditionalGeneration",
                 "text_encoding": "SwitchTransformersEncoderModel"},
        # 4 layers, sparse step 2 (layers 1 and 3 of each stack sparse), 4 experts with room for 8 tokens each,
        # no jitter, large router loss coefficients (so a wrong router loss shows)
        tiny_config=dict(vocab_size=61, d_model=16, d_kv=4, d_ff=24, num_heads=4, num_layers=4, num_decoder_layers=4,
                         num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_experts=4, expert_capacity=8,
                         router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0,
                         router_z_loss_coef=0.3, router_aux_loss_coef=0.2)),
)

__getattr__, __dir__, __all__ = family_exports(__name__, FAMILIES)
