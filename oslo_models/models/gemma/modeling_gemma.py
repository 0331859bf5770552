"""Gemma (1): the Llama decoder (``models/llama``) with Gemma's switches, and the base of Gemma 2 and 3.

What differs from Llama, and where:

- ``(1 + w)`` RMS norms, all in fp32 (``RMSNorm(formula="gemma")``, stored as the offset from one): the
  ``norm_formula`` of ``decoder_options``, which the layers and the final norm read;
- the token embeddings times ``sqrt(hidden_size)``, the factor rounded to the embeddings' dtype first (as
  ``transformers``' ``GemmaTextScaledWordEmbedding`` rounds its fp32 buffer to the weight's dtype, so bf16 scales
  by 8.0 for hidden 64 but by 55.5 for 3072): ``GemmaModel.embed``. Under tensor parallelism it multiplies the
  all-reduced ``[b, s, h]``, so every rank scales the same full embeddings; ``inputs_embeds`` passed by the caller
  are used as given (``transformers`` scales inside the embedding module, so it does not scale them either);
- GeGLU: the gated MLP with ``hidden_act`` (``gelu_pytorch_tanh``);
- ``head_dim`` independent of ``hidden_size / num_attention_heads``, tied embeddings: plain config values.

Gemma 2 (``models/gemma2``) and Gemma 3 (``models/gemma3_text``) subclass these classes. Shapes: b batch, s
sequence, h hidden.
"""
from __future__ import annotations

import dataclasses

import torch
import transformers

from ..common import GatedMLP
from ..llama import modeling_llama as llama
from .configuration_gemma import GemmaConfig

GEMMA_SPEC = dataclasses.replace(llama.LLAMA_SPEC)  # Llama's components; the norm formula is a switch


class GemmaPreTrainedModel(llama.LlamaPreTrainedModel):
    config_class = GemmaConfig
    stack_spec = GEMMA_SPEC
    #: config attribute of the MLP activation (Gemma 2/3: ``hidden_activation``)
    activation_attr = "hidden_act"

    @classmethod
    def validate_parallel_config(cls, config, parallel) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{cls.__name__}: use_bidirectional_attention=True (the bidirectional embedding variant) "
                             "is not implemented; the Gemma decoders here are causal")
        super().validate_parallel_config(config, parallel)

    @classmethod
    def decoder_options(cls, config) -> llama.DecoderOptions:
        return cls.biased_switches(config, norm_formula="gemma")

    @classmethod
    def build_mlp(cls, config, layer_idx: int, options=None):
        return GatedMLP(config.hidden_size, config.intermediate_size, act=getattr(config, cls.activation_attr))


class GemmaModel(GemmaPreTrainedModel, llama.LlamaModel):
    hf_twin = transformers.GemmaModel

    def embed(self, input_ids, inputs_embeds, position_ids, token_type_ids=None) -> torch.Tensor:
        """``embed_tokens(input_ids) * sqrt(h)`` ``[b, s, h]`` (the factor in the embeddings' dtype), or the
        caller's ``inputs_embeds`` unscaled (see the module docstring)."""
        if inputs_embeds is not None:
            return inputs_embeds
        hidden = self.embed_tokens(input_ids)  # [b, s, h], all-reduced over the vocab-parallel ranks
        return hidden * torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden.dtype)


GemmaPreTrainedModel.base_model_class = GemmaModel


class GemmaForCausalLM(GemmaPreTrainedModel, llama.LlamaForCausalLM):
    hf_twin, base_model_class = transformers.GemmaForCausalLM, GemmaModel


class GemmaForSequenceClassification(GemmaPreTrainedModel, llama.LlamaForSequenceClassification):
    hf_twin, base_model_class = transformers.GemmaForSequenceClassification, GemmaModel


class GemmaForTokenClassification(GemmaPreTrainedModel, llama.LlamaForTokenClassification):
    hf_twin, base_model_class = transformers.GemmaForTokenClassification, GemmaModel
