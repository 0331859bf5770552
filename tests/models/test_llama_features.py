"""Llama-family features beyond plain training parity: every ``rope_parameters`` type (and the legacy
``rope_scaling`` spelling) equals ``transformers``; ``generate`` under tp2 + SP with left padding equals
``transformers`` token for token (greedy with a KV cache, sliding-window cache included; sampling); the
classification / token / QA heads at tp2; activation checkpointing at tp2 + SP; the fused Triton RMSNorm and
rotary kernels equal the reference path in loss and gradients; clear errors for head counts that do not split;
the published ``base_model_tp_plan``."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.decoders import VOCAB, hf_class, om_class, save_tiny, tiny_config
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match, padded_batch

ROPE_VARIANTS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(4)],
                 "long_factor": [2.0 + i / 4 for i in range(4)], "original_max_position_embeddings": 16},
}


def _pair(model_type: str, head: str = "ForCausalLM", *, parallel=None, seed: int = 0, **overrides):
    """(ours via from_config, transformers' twin) drawn from the same seed."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    reference = hf_class(model_type, head)(config)
    torch.manual_seed(seed)
    model = om_class(model_type, head).from_config(config, parallel=parallel)
    return model, reference


@pytest.mark.parametrize("variant", list(ROPE_VARIANTS))
def test_rope_variants_match_transformers(variant):
    rope = ROPE_VARIANTS[variant]
    overrides = dict(max_position_embeddings=16, num_attention_heads=8, hidden_size=64)
    if rope is not None:
        overrides["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    model, reference = _pair("llama", **overrides)
    assert model.config.rope_parameters["rope_type"] == (rope or {"rope_type": "default"})["rope_type"]
    for seq in (24, 8, 24):  # past the original length and back: dynamic / longrope switch frequencies
        ids = torch.randint(1, VOCAB, (2, seq), generator=torch.Generator().manual_seed(seq))
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def test_legacy_rope_scaling_config_loads_as_transformers(tmp_path):
    path = save_tiny(tmp_path / "legacy", "llama")
    config_file = os.path.join(path, "config.json")
    with open(config_file) as handle:
        values = json.load(handle)
    values.pop("rope_parameters", None)
    values.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})  # transformers 4.x spelling
    with open(config_file, "w") as handle:
        json.dump(values, handle)
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False)
    reference = hf_class("llama").from_pretrained(path)
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert model.config.rope_parameters["rope_theta"] == 5000.0
    ids = torch.randint(1, VOCAB, (2, 20))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)


def _tp2_worker(paths: dict) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    prompt = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
    mask = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
    greedy = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    for model_type, path in paths.items():  # llama, mistral (sliding window cache), qwen3 (q/k norms)
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, progress=False)
        reference = hf_class(model_type).from_pretrained(path)
        ours, theirs = model.generate(prompt, **greedy), reference.generate(prompt, **greedy)
        assert ours.shape == (2, 16) and torch.equal(ours, theirs), (model_type, ours, theirs)
    sampling = dict(greedy, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(11)
    theirs = reference.generate(prompt, **sampling)
    torch.manual_seed(11)
    assert torch.equal(model.generate(prompt, **sampling), theirs)

    ids, mask, labels = padded_batch(VOCAB)
    for model_type in ("qwen2", "llama"):  # sequence classification (left- or right-padded rows)
        model, reference = _pair(model_type, "ForSequenceClassification", parallel=parallel, num_labels=3)
        expected = reference(ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
        got = model(ids, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    model, reference = _pair("mistral", "ForTokenClassification", parallel=parallel, num_labels=5)
    model.eval(), reference.eval()
    token_labels = labels.clamp(max=4)
    torch.testing.assert_close(model(ids, attention_mask=mask, labels=token_labels).loss,
                               reference(ids, attention_mask=mask, labels=token_labels).loss, atol=1e-5, rtol=1e-5)
    for model_type in ("mistral", "qwen3"):  # base model under "model" (Mistral), "transformer" (the others)
        model, reference = _pair(model_type, "ForQuestionAnswering", parallel=parallel)
        assert set(model.state_dict()) == set(reference.state_dict())
        positions = dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([4, 5, 9]))
        got, expected = model(ids, attention_mask=mask, **positions), reference(ids, attention_mask=mask, **positions)
        torch.testing.assert_close(got.start_logits, expected.start_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)

    # Activation checkpointing (recomputed blocks) gives the gradients of transformers.
    model, reference = _pair("qwen2", parallel=parallel)
    model.train(), reference.train()
    enable_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    reference(ids, attention_mask=mask, labels=labels).loss.backward()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def test_tp2_generate_heads_and_checkpointing_match_transformers(tmp_path):
    paths = {t: save_tiny(tmp_path / t, t) for t in ("llama", "mistral", "qwen3")}
    run_distributed(_tp2_worker, 2, paths, timeout=600)


@pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()),
                    reason="needs triton with TRITON_INTERPRET=1 set before import")
def test_fused_rms_norm_and_rotary_equal_reference(monkeypatch):
    """Qwen3 runs every fused op this family has (residual and q/k RMS norms, rotary): with the kernels forced (the
    Triton interpreter on CPU), loss and every gradient equal the reference path."""
    ids, mask, labels = padded_batch(VOCAB)

    def run(fused: bool):
        monkeypatch.setenv("OSLO_FUSED_OPS", "force" if fused else "0")
        torch.manual_seed(0)
        model = om.Qwen3ForCausalLM.from_config(tiny_config("qwen3"), parallel=om.ParallelConfig(fused_ops=fused))
        model.train()
        assert model.model.layers[0].self_attn.fused is fused and model.model.norm.fused is fused
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    loss_off, grads_off = run(False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss_on, grads_on = run(True)
    ran = {event.key for event in profile.key_averages()}
    assert {"oslo_models::rms_norm", "oslo_models::rms_norm_backward", "oslo_models::rotary_embedding"} <= ran
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("heads,kv_heads,tp,match", [
    (8, 2, 3, "num_attention_heads=8 is not divisible by tensor_parallel_size=3"),
    (12, 4, 6, "exceeds num_key_value_heads=4 but is not a multiple"),
    (12, 6, 4, "num_key_value_heads=6 is not divisible by tensor_parallel_size=4"),
])
def test_heads_that_do_not_split_are_a_clear_error(heads, kv_heads, tp, match):
    config = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=96,
                         intermediate_size=96 * tp)
    with pytest.raises(ValueError, match=match):  # raised before any process group is needed
        om.LlamaForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=tp))


def test_published_tensor_parallel_plans():
    for name in ("Llama", "Mistral", "Qwen2", "Qwen3"):
        plan = getattr(om, f"{name}Config").base_model_tp_plan
        # transformers' own entries for these types, in its vocabulary, plus the embeddings and norms
        theirs = getattr(transformers, f"{name}Config").base_model_tp_plan
        assert {key: plan[key] for key in theirs} == theirs
        assert plan["embed_tokens"] == "embedding_rowwise" and plan["norm"] == "sequence_parallel"
        assert ("layers.*.self_attn.q_norm" in plan) == (name == "Qwen3")
        assert "base_model_tp_plan" not in getattr(om, f"{name}Config")().to_dict()


def test_bf16_load_keeps_rotary_frequencies_fp32_like_transformers(tmp_path):
    """Models are built on the meta device and then allocated: the rotary frequencies (in no checkpoint) are
    recomputed in fp32, so bf16 logits equal transformers' bf16 logits exactly."""
    path = save_tiny(tmp_path / "yarn", "qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                 "rope_theta": 10000.0,
                                                                 "original_max_position_embeddings": 16})
    model = om.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, progress=False)
    reference = hf_class("qwen3").from_pretrained(path, dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq, atol=0, rtol=0)
    ids = torch.randint(1, VOCAB, (2, 20))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
