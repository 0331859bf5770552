from .configuration_mixtral import MixtralConfig
from .modeling_mixtral import MixtralForCausalLM, MixtralModel, MixtralPreTrainedModel

__all__ = ["MixtralConfig", "MixtralModel", "MixtralForCausalLM", "MixtralPreTrainedModel"]
