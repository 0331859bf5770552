from ..mixtral.configuration_mixtral import Qwen2MoeConfig
from .modeling_qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeModel, Qwen2MoePreTrainedModel

__all__ = ["Qwen2MoeConfig", "Qwen2MoeModel", "Qwen2MoeForCausalLM", "Qwen2MoePreTrainedModel"]
