"""BERT checkpoints both ways under tp=2 with sequence parallelism: a trained model saves what plain
``transformers`` reloads to the same logits, with exactly the source's keys; sliced loading from a sharded
checkpoint gives the same model; seeded init equals ``transformers``; the other heads (pre-training, token
classification, question answering, the base model) match ``transformers``; sizes that do not divide are
``ValueError``s before any process group exists."""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import (
    mlm_batch,
    save_tiny,
    single_thread,  # noqa: F401 (a fixture)
    tiny_bert_config,
)
from tests.helpers.models import assert_params_match

HEADS = {  # our Auto class -> transformers class, with a batch's extra inputs
    "pretraining": (om.AutoModelForPreTraining, transformers.BertForPreTraining, "prediction_logits"),
    "token": (om.AutoModelForTokenClassification, transformers.BertForTokenClassification, "logits"),
    "qa": (om.AutoModelForQuestionAnswering, transformers.BertForQuestionAnswering, "start_logits"),
    "base": (om.AutoModel, transformers.BertModel, "pooler_output"),
}


def _safetensors(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _label_kwargs(kind: str, labels: torch.Tensor) -> dict:
    return {"pretraining": dict(labels=labels, next_sentence_label=torch.tensor([0, 1, 1])),
            "token": dict(labels=labels.clamp(min=0) % 3), "base": {},
            "qa": dict(start_positions=torch.tensor([1, 0, 9]), end_positions=torch.tensor([3, 2, 5]))}[kind]


def _checkpoint_worker(root: str) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    inputs, labels = mlm_batch()
    source, single, sharded = (os.path.join(root, name) for name in ("mlm", "single", "sharded"))
    model = om.AutoModelForMaskedLM.from_pretrained(source, parallel=parallel, progress=False).train()
    model(**inputs, labels=labels).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # trained weights: the reload below is not a no-op
    model.eval()
    logits = model(**inputs).logits
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    again = om.AutoModelForMaskedLM.from_pretrained(sharded, parallel=parallel, progress=False)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    if torch.distributed.get_rank() == 0:
        assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
        assert _safetensors(single).keys() == _safetensors(sharded).keys() == _safetensors(source).keys()
        for folder in (single, sharded):
            plain = transformers.BertForMaskedLM.from_pretrained(folder)
            torch.testing.assert_close(plain(**inputs).logits, logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(plain.cls.predictions.bias,
                                  transformers.BertForMaskedLM.from_pretrained(source).cls.predictions.bias)

    for kind, (auto, hf_class, key) in HEADS.items():
        path = os.path.join(root, kind)
        reference = hf_class.from_pretrained(path)
        ours = auto.from_pretrained(path, parallel=parallel, progress=False)
        assert type(ours).__name__ == hf_class.__name__
        extra = _label_kwargs(kind, labels)
        expected, got = reference(**inputs, **extra), ours(**inputs, **extra)
        torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-5)
        if extra:
            torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)

    config = tiny_bert_config(vocab_size=103)
    torch.manual_seed(7)
    reference = transformers.BertForMaskedLM(config)
    torch.manual_seed(7)
    model = om.AutoModelForMaskedLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=2))
    assert_params_match(model, reference, atol=0, rtol=0)


def test_save_load_and_heads_under_tp2(tmp_path):
    save_tiny(tmp_path / "mlm", transformers.BertForMaskedLM, tiny_bert_config())
    for kind, (_, hf_class, _) in HEADS.items():
        save_tiny(tmp_path / kind, hf_class, tiny_bert_config(num_labels=3 if kind == "token" else 2))
    run_distributed(_checkpoint_worker, 2, str(tmp_path))


@pytest.mark.parametrize("overrides,tp,message", [
    (dict(num_attention_heads=4), 3, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    (dict(intermediate_size=66), 4, "intermediate_size=66 is not divisible by tensor_parallel_size=4"),
    (dict(hidden_size=30), 2, "hidden_size=30 is not divisible by num_attention_heads=4"),
])
def test_sizes_that_do_not_divide_are_value_errors(overrides, tp, message):
    config = tiny_bert_config(**overrides)
    with pytest.raises(ValueError, match=message):
        om.AutoModelForMaskedLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=tp))


def test_legacy_layernorm_gamma_beta_keys_load(tmp_path, single_thread):
    """Old Hub BERT checkpoints store ``LayerNorm.gamma/beta``; they load as transformers loads them."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = transformers.BertForMaskedLM(tiny_bert_config()).eval()
    with torch.no_grad():  # LayerNorms start at ones/zeros: move them, or a missed key would go unnoticed
        for name, param in reference.named_parameters():
            if "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    state = {key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
             for key, value in reference.state_dict().items() if "decoder" not in key}
    assert any(key.endswith("LayerNorm.gamma") for key in state)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    reference.config.save_pretrained(tmp_path)
    inputs, _ = mlm_batch()
    model = om.AutoModelForMaskedLM.from_pretrained(tmp_path, progress=False)
    torch.testing.assert_close(model(**inputs).logits, reference(**inputs).logits, atol=1e-6, rtol=1e-6)
