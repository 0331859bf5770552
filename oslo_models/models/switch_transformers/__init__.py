from .configuration_switch_transformers import SwitchTransformersConfig
from .modeling_switch_transformers import (
    SwitchTransformersEncoderModel,
    SwitchTransformersForConditionalGeneration,
    SwitchTransformersModel,
    SwitchTransformersPreTrainedModel,
)

__all__ = ["SwitchTransformersConfig", "SwitchTransformersModel", "SwitchTransformersForConditionalGeneration",
           "SwitchTransformersEncoderModel", "SwitchTransformersPreTrainedModel"]
