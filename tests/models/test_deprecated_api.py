"""No deprecated ``transformers`` API on the model path (issue 54).

``transformers`` 5.24 renamed ``past_key_values`` to ``cache`` in its mask builders (a ``FutureWarning``, which
``pyproject.toml``'s ``filterwarnings`` turns into an error) and in its model outputs (a log line, "`past_key_values`/
`cache_params` are deprecated", which no warning filter sees). Here a training forward (with labels) and a short
greedy ``generate`` of a stack decoder (Llama), GPT-2, BERT as a decoder, BART and T5 must emit neither: their
outputs and masks take the cache under the name the installed release uses (``models/common/attention/cache_names.py``).
The negative controls show the capture sees each kind of message when the old name is used. Runtime ~5 s.
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import logging as hf_logging

import oslo_models as om
from oslo_models.models.common.attention.cache_names import MASK_CACHE_KEYWORD, OUTPUT_CACHE_FIELD
from tests.helpers import zoo

CASES = [("llama", om.AutoModelForCausalLM, {}), ("gpt2", om.AutoModelForCausalLM, {}),
         ("bert", om.AutoModelForCausalLM, {"is_decoder": True}), ("bart", om.AutoModelForSeq2SeqLM, {}),
         ("t5", om.AutoModelForSeq2SeqLM, {})]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def deprecations():
    """The ``transformers`` log lines and the warnings raised inside the block whose text says "deprecated"."""
    handler, logger = _Records(), logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()  # a message logged once before in this process is logged again
    logger.addHandler(handler)
    found: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        logger.removeHandler(handler)
    found += [m for m in handler.messages if "deprecated" in m]
    found += [str(w.message) for w in caught
              if issubclass(w.category, (FutureWarning, DeprecationWarning)) and "deprecated" in str(w.message)]


@pytest.mark.parametrize("model_type, auto, overrides", CASES, ids=[case[0] for case in CASES])
def test_forward_and_generate_use_no_deprecated_name(model_type, auto, overrides):
    torch.manual_seed(0)
    model = auto.from_config(zoo.tiny_config(model_type, **overrides))
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    with deprecations() as found:
        extra = {"decoder_input_ids": ids[:, :4]} if auto is om.AutoModelForSeq2SeqLM else {}
        model.train()
        model(input_ids=ids, labels=ids if not extra else ids[:, :4], **extra).loss.backward()
        model.eval()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[-1] > (0 if extra else ids.shape[-1])
    assert found == [], found


def test_negative_controls_the_capture_sees_the_old_names():
    """Only where the installed ``transformers`` renamed the cache (5.24+): the old names are caught."""
    if OUTPUT_CACHE_FIELD != "cache" or MASK_CACHE_KEYWORD != "cache":
        pytest.skip("this transformers release still uses past_key_values")
    with deprecations() as found:
        CausalLMOutputWithPast(logits=torch.zeros(1), past_key_values=None)
    assert any("cache" in message for message in found), found
    config = zoo.tiny_config("llama")
    with deprecations() as found:
        create_causal_mask(config=config, inputs_embeds=torch.zeros(1, 4, 8), attention_mask=None,
                           past_key_values=None)
    assert any("past_key_values" in message for message in found), found
