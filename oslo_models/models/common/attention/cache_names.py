"""The name ``transformers`` gives the key/value cache, read once from its own signatures (not from a version string).

``transformers`` 5.24 renamed ``past_key_values`` to ``cache`` in the mask builders (``create_causal_mask(...,
cache=)``, the old keyword warns and goes in 5.40) and in the model outputs (``CausalLMOutputWithPast(cache=)``; the
old keyword and attribute log "`past_key_values`/`cache_params` are deprecated"). Older releases (5.17 on the GPU
box) know only ``past_key_values``. Every output this package builds passes :func:`cache_field` and every output it
reads goes through :func:`output_cache`, so neither name is spelled at a call site and no release warns.
"""
from __future__ import annotations

import dataclasses
import inspect

from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast

#: the keyword of ``create_causal_mask`` / ``create_sliding_window_causal_mask`` that takes the cache
MASK_CACHE_KEYWORD = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
#: the field of the ``transformers`` model outputs that holds the cache
OUTPUT_CACHE_FIELD = ("cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)}
                      else "past_key_values")


def cache_field(cache) -> dict:
    """``{name: cache}`` for a ``transformers`` model output's constructor, under the name this release uses."""
    return {OUTPUT_CACHE_FIELD: cache}


def output_cache(outputs):
    """The cache a ``transformers`` model output (or a tuple-less dict of one) holds, or ``None``."""
    return outputs.get(OUTPUT_CACHE_FIELD)


def seq2seq_fields(outputs) -> dict:
    """The fields of a ``Seq2Seq*Output`` besides a head's own (``loss``, ``logits``), from a ``Seq2SeqModelOutput``."""
    return {key: outputs.get(key) for key in (
        OUTPUT_CACHE_FIELD, "decoder_hidden_states", "decoder_attentions", "cross_attentions",
        "encoder_last_hidden_state", "encoder_hidden_states", "encoder_attentions")}


def _forward_cache_keyword() -> str:
    from transformers import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


#: the keyword a ``transformers`` model's ``forward`` takes the cache by (this package's models take both names)
FORWARD_CACHE_KEYWORD = _forward_cache_keyword()


def cache_kwargs(cache) -> dict:
    """``{keyword: cache}`` for calling a ``transformers`` model's ``forward`` without its deprecation warning."""
    return {FORWARD_CACHE_KEYWORD: cache}
