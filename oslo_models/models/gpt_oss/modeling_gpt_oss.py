"""gpt-oss: the Llama-shaped MoE decoder (``models/mixtral``) with gpt-oss's components:

- attention: ``common.attention.attention_variants.SinkAttention`` (one learned sink logit per head joins each softmax;
  split with the heads under TP), biases on q/k/v/o (``attention_bias``), sliding-window and full layers alternating per
  ``config.layer_types`` (the mask of each layer's type; the window passed on to the kernel); eager/flex/flash
  kernels only (``transformers`` has no SDPA path for sinks, ``_supports_sdpa = False`` as there);
- feed-forward: ``common.feed_forward.moe_variants.ClampedSwigluMoe`` in every layer (router with a bias, softmax over
  the top-k logits; experts with biases, interleaved gate|up and a clamped SwiGLU, ``swiglu_alpha`` / ``swiglu_limit``);
- norms: RMS with ``transformers``' gpt-oss rounding (scale in fp32, then cast: the ``"olmo2"`` formula);
- rotary: ``RotaryEmbedding`` (``transformers``' own init functions; gpt-oss's default is yarn). gpt-oss applies it
  to the two halves of each head with half-width ``cos``/``sin``, which is the Llama rule on ``cat(freqs, freqs)``.

Router losses as ``transformers``: ``router_logits`` and the load-balancing ``aux_loss`` with
``output_router_logits``, added times ``router_aux_loss_coef`` to the loss (``MixtralForCausalLM``'s forward, the
same ``load_balancing_loss_func``); pipeline stages carry its statistics (``pipeline_mixtral.py``).

Checkpoints: ``transformers`` stores gpt-oss's experts stacked (``mlp.experts.gate_up_proj [E, h, 2i]`` ...), so
they are read and written as they are (no per-expert conversion). Checkpoints whose experts are MXFP4-quantized
(``quantization_config.quant_method == "mxfp4"``, ``*_blocks``/``*_scales`` tensors, as the Hub's) are dequantized
to the load dtype on load (``mxfp4.py``, ``transformers``' helper; each rank only its experts); the model then
holds and saves dense weights, without the ``quantization_config``. Other quantization methods are refused with a
``ValueError`` before anything is built.
"""
from __future__ import annotations

import dataclasses

import transformers
from transformers.utils.output_capturing import OutputRecorder

from ...parallel_layers.moe.router_variants import BiasedTopKRouter
from ..common.attention.attention_variants import SinkAttention
from ..common.feed_forward.moe_variants import ClampedSwigluMoe
from ..common.loading.expert_keys import ExpertKeyLayout
from ..common.rules.capabilities import Capabilities
from ..llama import modeling_llama as llama
from ..mixtral import modeling_mixtral as mixtral
from .configuration_gpt_oss import GptOssConfig
from .mxfp4 import Mxfp4Reader, is_mxfp4

GPT_OSS_SPEC = dataclasses.replace(
    mixtral.MOE_SPEC, components={**mixtral.MOE_SPEC.components, "attn": SinkAttention, "mlp": ClampedSwigluMoe})


def check_not_quantized(config) -> None:
    """``ValueError`` for a config whose checkpoint holds quantized weights other than MXFP4 experts (which are
    dequantized on load)."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization or is_mxfp4(config):
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
        quantization, "quant_method", quantization)
    raise ValueError(f"{config.model_type}: checkpoints with {method!s}-quantized weights (quantization_config "
                     f"quant_method={method!s}) are not supported (only MXFP4 experts, dequantized on load); "
                     "dequantize them with their own tool, save_pretrained, and load that folder")


def swiglu_constants(config) -> tuple[float, float]:
    """The experts' SwiGLU ``(alpha, limit)`` as the installed ``transformers`` applies them. Since ``swiglu_alpha``
    and ``swiglu_limit`` became config fields, ``transformers`` reads them from the config; before (5.17 and
    earlier) its experts hard-coded 1.702 and 7.0 (the released checkpoints' values) and ignored the config's,
    so a config with other values gave other outputs there. Found by the GPU smoke test, whose machine had 5.17."""
    if hasattr(transformers.GptOssConfig, "swiglu_limit"):
        return config.swiglu_alpha, config.swiglu_limit
    return 1.702, 7.0


class GptOssPreTrainedModel(mixtral.MixtralPreTrainedModel):
    config_class = GptOssConfig
    stack_spec = GPT_OSS_SPEC
    expert_key_layout = ExpertKeyLayout(stacked=())  # stacked on the Hub too: keys pass through unchanged
    record_outputs = {"router_logits": OutputRecorder(BiasedTopKRouter, index=0)}

    # its MoE block routes like SparseMoeBlock (moe.route_tokens): sequence parallelism and pipeline x tp/ep run;
    # context parallelism: the cores take the sinks, the router loss is Mixtral's (statistics summed over cp)
    # moe_grid: its router is not the grid-planned TopKRouter, the 2D grid is refused
    capabilities = Capabilities(moe_sequence_parallel=True, moe_grid=False, moe_context_parallel=True)

    @classmethod
    def expert_intermediate_size(cls, config) -> int:
        return config.intermediate_size

    @classmethod
    def decoder_options(cls, config) -> mixtral.MoeOptions:
        return cls.biased_switches(config, norm_formula="olmo2")

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options=None):
        alpha, limit = swiglu_constants(config)
        return ClampedSwigluMoe(config.hidden_size, num_experts=config.num_local_experts,
                                top_k=config.num_experts_per_tok, intermediate_size=config.intermediate_size,
                                alpha=alpha, limit=limit)

    def load_from_reader(self, reader, **options):
        if is_mxfp4(self.config):  # dense from here on: the saved config must not claim quantized experts
            reader = Mxfp4Reader.wrap(reader)
            del self.config.quantization_config
        return super().load_from_reader(reader, **options)

    @classmethod
    def validate_parallel_config(cls, config, parallel) -> None:
        check_not_quantized(config)
        super().validate_parallel_config(config, parallel)


class GptOssModel(GptOssPreTrainedModel, mixtral.MixtralModel):
    hf_twin = transformers.GptOssModel


GptOssPreTrainedModel.base_model_class = GptOssModel


class GptOssForCausalLM(GptOssPreTrainedModel, mixtral.MixtralForCausalLM):
    hf_twin = transformers.GptOssForCausalLM


class GptOssForSequenceClassification(GptOssPreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin = transformers.GptOssForSequenceClassification


class GptOssForTokenClassification(GptOssPreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin = transformers.GptOssForTokenClassification
