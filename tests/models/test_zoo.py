"""The zoo: one parity test over every family record with a causal LM head, plus a throwaway family declared here.

For each model type (its tiny model from the record, ``tests/helpers/zoo.py``), against the single-process
``transformers`` twin built from the same weights:

- tp=1 in this process: logits, loss and every gradient on a left-padded batch; a hand-written decode loop
  (``model(ids, past_key_values=cache)``, no ``position_ids``: the stack derives them from the cache) step by step;
- one spawned group of 2 ranks running two layouts: tp=2 (+ sequence parallelism where the family allows it) with
  the same checks, then pp=2 (one AdamW step through ``train_step``: loss, every local gradient and parameter;
  1F1B with 2 microbatches, GPipe with one for the MoE decoders).

The throwaway family ``oslo_toy_llama`` is a config class, a ``StackSpec`` and a ``FamilyRecord``, nothing else (the
classes are declared from them: ``oslo_models/models/declare.py``): the cost of a new Llama-shaped family.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.declare import declare_stack_family
from oslo_models.models.family import FamilyRecord
from oslo_models.models.heads import ForCausalLM
from oslo_models.models.llama import TINY_DECODER
from oslo_models.models.llama.modeling_llama import LLAMA_SPEC, LlamaPreTrainedModel
from oslo_models.models.registry import families, register_family, unregister_family
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.pipeline import assert_pipeline_matches
from tests.helpers.zoo import tiny_config

# ------------------------------------------------------------------ the throwaway family: record + spec
TOY_TYPE = "oslo_toy_llama"


class ToyConfig(transformers.LlamaConfig):
    model_type = TOY_TYPE


TOY_SPEC = dataclasses.replace(LLAMA_SPEC)
globals().update(declare_stack_family(
    "Toy", ToyConfig, TOY_SPEC, like=LlamaPreTrainedModel, module=__name__,
    hf_twins={"base": transformers.LlamaModel, "causal_lm": transformers.LlamaForCausalLM}))
TOY = FamilyRecord(model_type=TOY_TYPE, package=__name__, config="ToyConfig",
                   classes={"base": "ToyModel", "causal_lm": "ToyForCausalLM"},
                   tiny_config={**TINY_DECODER, "attention_bias": True}, spec="TOY_SPEC")
# ------------------------------------------------------------------


def _causal_types() -> list[str]:
    """The decoder families: a record whose causal LM is the generic stack head (BERT's LM head is an encoder's)."""
    return [r.model_type for r in families()
            if "causal_lm" in r.classes and issubclass(r.model_class("causal_lm"), ForCausalLM)] + [TOY_TYPE]


def _om_class(model_type: str) -> type:
    record = TOY if model_type == TOY_TYPE else next(r for r in families() if r.model_type == model_type)
    return record.model_class("causal_lm")


def _is_moe(config) -> bool:
    return bool(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))


def _config(model_type: str):
    if model_type == TOY_TYPE:
        return ToyConfig(**TOY.tiny_config)
    return tiny_config(model_type)


def _save_reference(model_type: str, folder) -> str:
    torch.manual_seed(0)
    reference = _om_class(model_type).hf_twin(_config(model_type))
    reference.save_pretrained(folder)
    return str(folder)


def _reference(model_type: str, path: str):
    return _om_class(model_type).hf_twin.from_pretrained(path).train()


def _check_forward_and_grads(model, reference) -> None:
    ids, mask, labels = padded_batch(reference.config.vocab_size, batch=2, seq=8)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def _check_decode_loop(model, reference) -> None:
    """Prefill 5 tokens, then 4 one-token steps with only the cache (no position ids, no mask)."""
    model.eval(), reference.eval()
    ids = torch.randint(3, reference.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    caches = [transformers.DynamicCache(config=reference.config) for _ in range(2)]
    with torch.no_grad():
        for start, stop in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]:
            expected = reference(ids[:, start:stop], past_key_values=caches[0]).logits
            got = model(ids[:, start:stop], past_key_values=caches[1]).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m, s=start: f"step {s}: {m}")


def _layouts_worker(model_type: str, path: str) -> None:
    register_family(TOY, exist_ok=True)  # a spawned process imports this module afresh: register it there too
    om_class, config = _om_class(model_type), _config(model_type)
    # tp = 2 (sequence parallelism where the family runs it; the MoE decoders refuse it)
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=not _is_moe(config))
    model = om_class.from_pretrained(path, parallel=parallel, progress=False).train()
    reference = _reference(model_type, path)
    _check_forward_and_grads(model, reference)
    _check_decode_loop(model, reference)
    # pp = 2: one AdamW step through a 1F1B schedule (the MoE decoders: one microbatch, where their per-microbatch
    # load-balancing loss is transformers' loss of the batch)
    schedule = dict(pipeline_schedule="gpipe", num_microbatches=1) if _is_moe(config) else dict(num_microbatches=2)
    parallel = om.ParallelConfig(pipeline_parallel_size=2, pipeline_partition="parameters", **schedule)
    model = om_class.from_pretrained(path, parallel=parallel, progress=False).train()
    ids, mask, labels = padded_batch(config.vocab_size, batch=2, seq=8)
    assert_pipeline_matches(model, _reference(model_type, path),
                            {"input_ids": ids, "attention_mask": mask, "labels": labels}, steps=1)


@pytest.fixture
def toy_registered():
    register_family(TOY, exist_ok=True)
    yield
    unregister_family(TOY_TYPE)


@pytest.mark.parametrize("model_type", _causal_types())
def test_zoo_parity(model_type, tmp_path, toy_registered):
    path = _save_reference(model_type, tmp_path / model_type)
    model = _om_class(model_type).from_pretrained(path, progress=False).train()
    reference = _reference(model_type, path)
    twin_name = type(reference).__name__
    assert type(model).__name__ == (twin_name.replace("Llama", "Toy") if model_type == TOY_TYPE else twin_name)
    _check_forward_and_grads(model, reference)
    _check_decode_loop(model, reference)
    run_distributed(_layouts_worker, 2, model_type, path)


def test_throwaway_family_is_a_record_and_a_spec(toy_registered):
    """The declared family goes through the Auto classes, derives its plan from the spec and refuses bad sizes."""
    config = ToyConfig(**TOY.tiny_config)
    model = om.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "ToyForCausalLM" and type(model.model).__name__ == "ToyModel"
    assert model.parallel_plan.styles.keys() == om.LlamaForCausalLM.parallel_plan.styles.keys()
    assert type(model).pipeline_adapter().layer_paths == ("model.layers",)
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=3))
