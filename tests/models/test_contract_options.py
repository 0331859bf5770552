"""``from_pretrained`` / ``save_pretrained`` options, dtype rules, class flags, runtime attention switching,
``shift_labels`` and ``problem_type`` as ``transformers`` has them (tp1, in process; tp2 in
``test_contract_parity.py``)."""
from __future__ import annotations

import logging

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.models import tiny_gpt2_config

_BERT = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_T5 = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    made = {}
    for name, model in (("bert_cls", transformers.BertForSequenceClassification(transformers.BertConfig(**_BERT))),
                        ("t5", transformers.T5ForConditionalGeneration(transformers.T5Config(**_T5))),
                        ("gpt2", transformers.GPT2LMHeadModel(tiny_gpt2_config()))):
        torch.manual_seed(0)
        model.save_pretrained(root / name)
        made[name] = str(root / name)
    return made


def test_ignore_mismatched_sizes_and_loading_info(folders):
    with pytest.raises(ValueError, match="ignore_mismatched_sizes"):
        om.BertForSequenceClassification.from_pretrained(folders["bert_cls"], num_labels=5, progress=False)
    with pytest.raises(RuntimeError):  # what transformers raises, for code that catches that
        om.BertForSequenceClassification.from_pretrained(folders["bert_cls"], num_labels=5, progress=False)
    model, info = om.BertForSequenceClassification.from_pretrained(
        folders["bert_cls"], num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True, progress=False)
    _, expected = transformers.BertForSequenceClassification.from_pretrained(
        folders["bert_cls"], num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    assert {key for key, _, _ in info["mismatched_keys"]} == {key for key, _, _ in expected["mismatched_keys"]}
    assert info["mismatched_keys"] == {("classifier.weight", (2, 32), (5, 32)), ("classifier.bias", (2,), (5,))}
    assert set(info) == set(expected) and not info["missing_keys"] and not info["unexpected_keys"]
    assert model.classifier.weight.shape == (5, 32)
    reference = transformers.BertForSequenceClassification.from_pretrained(folders["bert_cls"])
    torch.testing.assert_close(model.bert.pooler.dense.weight, reference.bert.pooler.dense.weight)


def test_torch_dtype_keeps_fp32_modules_and_warns(folders, caplog):
    with caplog.at_level(logging.WARNING):
        model = om.T5ForConditionalGeneration.from_pretrained(folders["t5"], torch_dtype=torch.float16, progress=False)
    assert "`torch_dtype` is deprecated! Use `dtype` instead!" in caplog.text
    reference = transformers.T5ForConditionalGeneration.from_pretrained(folders["t5"], dtype=torch.float16)
    ours = {name: p.dtype for name, p in model.named_parameters()}
    theirs = {name: p.dtype for name, p in reference.named_parameters()}
    assert ours == theirs and ours["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == torch.float32
    assert ours["encoder.block.0.layer.1.DenseReluDense.wi.weight"] == torch.float16
    bf16 = om.T5ForConditionalGeneration.from_pretrained(folders["t5"], dtype=torch.bfloat16, progress=False)
    assert bf16.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.bfloat16  # fp16 only, as HF


@pytest.mark.parametrize("device_map", ["cpu", "auto", {"": "cpu"}, torch.device("cpu")])
def test_device_map_single_device_accepted(folders, device_map):
    model = om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], device_map=device_map, progress=False)
    assert model.lm_head.weight.device.type == "cpu"


@pytest.mark.parametrize("device_map", ["balanced", "sequential", {"transformer": "cpu", "lm_head": "cuda:0"}])
def test_device_map_that_splits_is_refused(folders, device_map):
    with pytest.raises(ValueError, match="parallel=ParallelConfig"):
        om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], device_map=device_map, progress=False)


def test_state_dict_without_a_path(folders):
    reference = transformers.GPT2LMHeadModel.from_pretrained(folders["gpt2"])
    model = om.GPT2LMHeadModel.from_pretrained(None, config=reference.config, state_dict=reference.state_dict(),
                                               progress=False)
    ids = torch.randint(0, 101, (2, 5))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    with pytest.raises(ValueError, match="config= and state_dict="):
        om.GPT2LMHeadModel.from_pretrained(None, state_dict=reference.state_dict())
    with pytest.raises(ValueError, match="cannot be passed together"):
        om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], state_dict=reference.state_dict())


def test_options_passed_refused_or_rejected(folders, tmp_path):
    model = om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], output_hidden_states=True, low_cpu_mem_usage=True,
                                               attn_implementation="eager", progress=False)
    assert model.config.output_hidden_states and model.config._attn_implementation == "eager"
    assert len(model(torch.tensor([[1, 2, 3]])).hidden_states) == 3
    with pytest.raises(ValueError, match="quantization"):
        om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], quantization_config={"load_in_8bit": True})
    with pytest.raises(ValueError, match="Unknown from_pretrained option"):
        om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], not_an_option=3)
    with pytest.raises(ValueError, match="safetensors only"):
        model.save_pretrained(tmp_path, safe_serialization=False)
    with pytest.raises(RuntimeError, match="meta device"), torch.device("meta"):
        om.GPT2LMHeadModel.from_pretrained(folders["gpt2"])


def test_class_flags_match_transformers():
    pairs = [(om.GPT2LMHeadModel, transformers.GPT2LMHeadModel), (om.BertForMaskedLM, transformers.BertForMaskedLM),
             (om.RobertaForMaskedLM, transformers.RobertaForMaskedLM),
             (om.T5ForConditionalGeneration, transformers.T5ForConditionalGeneration)]
    for ours, theirs in pairs:
        for flag in ("_supports_sdpa", "_supports_flash_attn", "_supports_flex_attn", "_supports_attention_backend",
                     "_keep_in_fp32_modules", "supports_gradient_checkpointing", "base_model_prefix"):
            assert getattr(ours, flag, None) == getattr(theirs, flag, None), (ours.__name__, flag)
        module = __import__(ours.__module__, fromlist=["_"])
        for name in ours._no_split_modules:  # accelerate finds these by class name in our module tree
            assert any(type(m).__name__ == name for m in ours.from_config(theirs.config_class(**(
                _T5 if "T5" in ours.__name__ else _BERT if "Ber" in ours.__name__ or "Rob" in ours.__name__
                else dict(n_embd=32, n_layer=1, n_head=4, vocab_size=50)))).modules()), (ours.__name__, name, module)


def test_set_attn_implementation_at_runtime(folders):
    model = om.T5ForConditionalGeneration.from_pretrained(folders["t5"], progress=False)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(folders["t5"])
    ids = torch.randint(2, 99, (2, 5))
    for implementation in ("eager", "sdpa", "eager"):
        model.set_attn_implementation(implementation)
        reference.set_attn_implementation(implementation)
        got = model(input_ids=ids, decoder_input_ids=ids, output_attentions=True)
        expected = reference(input_ids=ids, decoder_input_ids=ids, output_attentions=True)
        assert len(got.encoder_attentions) == len(expected.encoder_attentions) == (2 if implementation == "eager"
                                                                                  else 0)
        for a, b in zip(got.cross_attentions, expected.cross_attentions):
            torch.testing.assert_close(a, b)


def test_shift_labels_and_problem_type(folders):
    model = om.GPT2LMHeadModel.from_pretrained(folders["gpt2"], progress=False)
    reference = transformers.GPT2LMHeadModel.from_pretrained(folders["gpt2"])
    ids = torch.randint(1, 101, (2, 6))
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    torch.testing.assert_close(model(ids, labels=ids, shift_labels=shifted).loss, model(ids, labels=ids).loss)
    shifted[:, :2] = -100  # pre-shifted targets that differ from shifting labels: honoured as given
    got = model(ids, labels=ids, shift_labels=shifted).loss
    torch.testing.assert_close(got, reference(ids, labels=ids, shift_labels=shifted).loss)
    assert not torch.allclose(got, model(ids, labels=ids).loss)
    config = transformers.BertConfig(**_BERT)
    config.problem_type, config.num_labels = "single_label_classification", 1  # accepted by transformers
    torch.manual_seed(0)
    ours = om.BertForSequenceClassification(config)
    assert ours.config.problem_type == "single_label_classification"
    loss = ours(torch.randint(2, 99, (2, 5)), labels=torch.tensor([0, 0])).loss
    assert torch.isfinite(loss)
