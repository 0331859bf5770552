"""``transformers``' own ``ModelTesterMixin`` (its ``tests/test_modeling_common.py``, unmodified, fetched for the
installed version: see ``fetch.py``) run on this project's classes for every family.

Each family's test class subclasses ``ModelTesterMixin`` with ``all_model_classes`` set to our classes and our
model tester (``testers.py``). Tests that cannot apply on CPU, or that check a property our design does not have on
purpose, are skipped by name in ``SKIPS`` below, each with its reason; nothing else is changed. The slowest tests
are marked ``slow`` (``-m "not slow"`` deselects them).
"""
from __future__ import annotations

import unittest

import pytest

import oslo_models as om

from .fetch import load_common
from .selection import CORE  # noqa: F401  (used by conftest.py)
from .testers import (
    BertTester,
    GPT2Tester,
    GPTJTester,
    GPTNeoXTester,
    LlamaTester,
    PhiTester,
    Qwen2Tester,
    RobertaTester,
    T5EncoderTester,
    T5Tester,
)

common, reason = load_common()
if common is None:
    pytest.skip(reason, allow_module_level=True)

_CPU = "needs a CUDA device (flash attention / multi-GPU / fp16 kernels); this suite runs on CPU"
SKIPS = {
    # placeholders for modules the sdist does not ship (fetch.py)
    "test_generation_tester_mixin_inheritance": "GenerationTesterMixin (tests/generation/) is not in the sdist",
}
SLOW = {"test_torch_compile_for_training", "test_sdpa_can_compile_dynamic", "test_batching_equivalence",
        "test_eager_matches_sdpa_inference", "test_can_load_ignoring_mismatched_shapes"}


def _skip(reason_: str):
    @unittest.skip(reason_)
    def skipped(self, *args, **kwargs):
        pass

    return skipped


def family_test(name: str, tester, model_classes, *, skips=(), **attributes):
    """A ``unittest.TestCase`` running ``ModelTesterMixin`` on ``model_classes`` with ``tester``.

    Labels come from ``ModelTesterMixin._prepare_for_class`` plus the tester's ``extra_labels`` (what
    ``transformers``' family test files add, e.g. BERT pre-training's ``next_sentence_label``)."""
    body = dict(all_model_classes=tuple(model_classes), **attributes)
    body["setUp"] = lambda self: setattr(self, "model_tester", tester(self))

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        inputs = common.ModelTesterMixin._prepare_for_class(self, inputs_dict, model_class, return_labels)
        if return_labels:
            inputs.update(self.model_tester.extra_labels(model_class))
        return inputs

    body["_prepare_for_class"] = _prepare_for_class
    for test_name, why in {**SKIPS, **dict(skips)}.items():  # also parameterized expansions (name_00_...)
        for attribute in dir(common.ModelTesterMixin):
            suffix = attribute[len(test_name) + 1:]
            if attribute == test_name or attribute.startswith(test_name + "_") and suffix[:1].isdigit():
                body[attribute] = _skip(why)
    cls = type(name, (common.ModelTesterMixin, unittest.TestCase), body)
    for test_name in SLOW:
        if hasattr(cls, test_name):
            setattr(cls, test_name, pytest.mark.slow(getattr(cls, test_name)))
    return cls


GPT2CommonTest = family_test("GPT2CommonTest", GPT2Tester, (
    om.GPT2Model, om.GPT2LMHeadModel, om.GPT2ForSequenceClassification, om.GPT2ForTokenClassification,
    om.GPT2ForQuestionAnswering))
BertCommonTest = family_test("BertCommonTest", BertTester, (
    om.BertModel, om.BertForMaskedLM, om.BertForPreTraining, om.BertForSequenceClassification,
    om.BertForTokenClassification, om.BertForQuestionAnswering, om.BertForMultipleChoice,
    om.BertForNextSentencePrediction, om.BertLMHeadModel))
RobertaCommonTest = family_test("RobertaCommonTest", RobertaTester, (
    om.RobertaModel, om.RobertaForMaskedLM, om.RobertaForSequenceClassification, om.RobertaForTokenClassification,
    om.RobertaForQuestionAnswering, om.RobertaForMultipleChoice, om.RobertaForCausalLM))
T5CommonTest = family_test("T5CommonTest", T5Tester, (
    om.T5Model, om.T5ForConditionalGeneration, om.T5ForSequenceClassification, om.T5ForQuestionAnswering),
    is_encoder_decoder=True, skips={
        "test_model_base_model_prefix": "T5ForConditionalGeneration keeps shared/encoder/decoder at the top with no "
                                        "`transformer` attribute; transformers' own T5 class fails it the same way",
        "test_eager_matches_sdpa_inference": "T5ForSequenceClassification needs one <eos> per row; this test pads "
                                             "rows of the common inputs and removes it",
        "test_inputs_embeds": "T5ForSequenceClassification refuses inputs_embeds (it reads <eos> from input_ids), "
                              "exactly as transformers' class does",
    })
T5EncoderCommonTest = family_test("T5EncoderCommonTest", T5EncoderTester, (
    om.T5EncoderModel, om.T5ForTokenClassification))
LlamaCommonTest = family_test("LlamaCommonTest", LlamaTester, (
    om.LlamaModel, om.LlamaForCausalLM, om.LlamaForSequenceClassification, om.LlamaForTokenClassification,
    om.LlamaForQuestionAnswering))
Qwen2CommonTest = family_test("Qwen2CommonTest", Qwen2Tester, (
    om.Qwen2Model, om.Qwen2ForCausalLM, om.Qwen2ForSequenceClassification, om.Qwen2ForTokenClassification,
    om.Qwen2ForQuestionAnswering))
GPTNeoXCommonTest = family_test("GPTNeoXCommonTest", GPTNeoXTester, (
    om.GPTNeoXModel, om.GPTNeoXForCausalLM, om.GPTNeoXForSequenceClassification, om.GPTNeoXForTokenClassification,
    om.GPTNeoXForQuestionAnswering))
GPTJCommonTest = family_test("GPTJCommonTest", GPTJTester, (
    om.GPTJModel, om.GPTJForCausalLM, om.GPTJForSequenceClassification, om.GPTJForQuestionAnswering))
PhiCommonTest = family_test("PhiCommonTest", PhiTester, (
    om.PhiModel, om.PhiForCausalLM, om.PhiForSequenceClassification, om.PhiForTokenClassification))
