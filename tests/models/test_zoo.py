"""The zoo: one parity test over every family record with a causal LM head, plus a throwaway family declared here.

For each model type (its tiny model from the record, ``tests/helpers/zoo.py``), against the single-process
``transformers`` twin built from the same weights:

- tp=1 in this process: logits, loss and every gradient on a left-padded batch; a hand-written decode loop
  (``model(ids, past_key_values=cache)``, no ``position_ids``: the stack derives them from the cache) step by step;
- tp=1 in this process too: ``save_pretrained`` -> plain ``transformers`` (same keys and logits), and activation
  checkpointing (recomputed blocks, same gradients);
- one spawned group of 4 ranks, one AdamW step per layout (``tests/helpers/layouts.py``): tp=2 with sequence
  parallelism x dp=2 under ZeRO-3 through ``om.training.prepare`` (then, on the trained and sharded weights, the
  decode loop and ``generate`` greedy and sampled on a left-padded prompt, token for token), tp=4 (key/value heads
  replicated), pp=2 x tp=2 (``train_step``, 1F1B with 2 microbatches; the MoE decoders: GPipe over pp=2 x dp=2),
  and context parallelism (ring) x dp=2 under ZeRO-1.

A layout the validation code refuses (before any process group) must be one ``REFUSED`` lists for the type, with
its reason; every other layout must run and match.

The throwaway family ``oslo_toy_llama`` is added in this one file as ``docs/adding-a-model.md`` says: a config class,
a ``StackSpec``, one explicit line per class (as ``transformers``' generated files write them) and a
``FamilyRecord``: the cost of a new Llama-shaped family.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from transformers.modeling_layers import GradientCheckpointingLayer

import oslo_models as om
from oslo_models.models.common.attention.cache_names import cache_kwargs
from oslo_models.models.common.stack.context_parallel import check_context_parallel
from oslo_models.models.family import FamilyRecord, decoder_classes
from oslo_models.models.heads import ForCausalLM
from oslo_models.models.llama import TINY_DECODER
from oslo_models.models.llama.modeling_llama import LLAMA_SPEC, LlamaForCausalLM, LlamaModel, LlamaPreTrainedModel
from oslo_models.models.registry import families, register_family, unregister_family
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.pipeline import assert_pipeline_matches
from tests.helpers.zoo import tiny_config

# ------------------------------------------------------------------ the throwaway family: spec + classes + record
TOY_TYPE = "oslo_toy_llama"


class ToyConfig(transformers.LlamaConfig):
    model_type = TOY_TYPE


TOY_SPEC = dataclasses.replace(LLAMA_SPEC)  # other block, parts or components here


class ToyPreTrainedModel(LlamaPreTrainedModel):
    config_class, stack_spec = ToyConfig, TOY_SPEC


class ToyModel(ToyPreTrainedModel, LlamaModel):
    hf_twin = transformers.LlamaModel


ToyPreTrainedModel.base_model_class = ToyModel


class ToyForCausalLM(ToyPreTrainedModel, LlamaForCausalLM):
    hf_twin = transformers.LlamaForCausalLM


TOY = FamilyRecord(model_type=TOY_TYPE, package=__name__, config="ToyConfig",
                   classes=decoder_classes("Toy", ("base", "causal_lm")),
                   tiny_config={**TINY_DECODER, "attention_bias": True}, spec="TOY_SPEC")
# ------------------------------------------------------------------

# The layouts the validation code refuses for a type, with a fragment of the reason; every other layout of the zoo
# must run and match transformers.
# The MoE decoders run every layout (sequence parallelism, pp x tp, cp with the load-balancing statistics summed
# over cp), and so does Gemma 2 (the cp cores soft-cap inside each block): no entry.
# DeepSeek-V3's MLA, gpt-oss's attention sinks and Bloom's ALiBi run under context parallelism too (the cores take
# narrower values, the sink logit and the ALiBi bias: tests/parallel_layers/test_context_parallel_score_mods.py)
REFUSED: dict[str, dict[str, str]] = {}


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
            expected = reference(ids[:, start:stop], **cache_kwargs(caches[0])).logits
            got = model(ids[:, start:stop], past_key_values=caches[1]).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=lambda m, s=start: f"step {s}: {m}")


def _check_save_load(model, reference, folder) -> None:
    """``save_pretrained`` -> plain ``transformers``: the same keys and logits."""
    model.save_pretrained(folder)
    reloaded = type(reference).from_pretrained(folder).eval()
    assert set(reloaded.state_dict()) == set(reference.state_dict())
    ids, mask, _ = padded_batch(reference.config.vocab_size, batch=2, seq=8)
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits,
                                   reference(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-4)


def _check_activation_checkpointing(model_type: str, path: str) -> None:
    """Recomputed blocks give the same gradients."""
    model = _om_class(model_type).from_pretrained(path, progress=False).train()
    enable_checkpointing(model)
    layers = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    _check_forward_and_grads(model, _reference(model_type, path))


def _refusal(om_class, config, **layout) -> str | None:
    """The validation code's refusal of ``layout`` for this class and config (raised before any process group),
    or ``None`` when the layout is accepted."""
    parallel = om.ParallelConfig(**layout)
    try:
        om_class.validate_parallel_config(config, parallel)
        check_context_parallel(om_class, config, parallel)
    except (ValueError, NotImplementedError) as error:
        return str(error)
    return None


def _check_generate(model, reference) -> None:
    """Greedy and sampled ``generate`` on a left-padded prompt, token for token."""
    prompt = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
    mask = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
    greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    if _is_moe(reference.config):  # transformers' load-balancing loss cannot take a decode step's padded mask
        greedy["output_router_logits"] = False
    model.eval(), reference.eval()
    assert torch.equal(model.generate(prompt, **greedy), reference.generate(prompt, **greedy))
    sampling = dict(greedy, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(11)
    theirs = reference.generate(prompt, **sampling)
    torch.manual_seed(11)
    assert torch.equal(model.generate(prompt, **sampling), theirs)


def _batch(config, rows: int = 4, seq: int = 16) -> dict:
    ids, mask, labels = padded_batch(config.vocab_size, batch=rows, seq=seq)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _assert_refusals(model_type: str, refused: dict) -> None:
    """The layouts refused are exactly those ``REFUSED`` expects for this type (each with its reason)."""
    expected = REFUSED.get(model_type, {})
    assert set(refused) == set(expected), (model_type, refused)
    for name, why in expected.items():
        assert why in refused[name], (model_type, name, refused[name])


def _layouts_worker(model_type: str, path: str) -> None:
    """Four ranks, one AdamW step per layout against transformers on the whole batch; a layout the validation code
    refuses is recorded with its reason (every rank takes the same decisions: they depend on the config only)."""
    om_class, config = _om_class(model_type), _config(model_type)
    refused = {}

    def run(name: str, zero_stage: int = 0, **layout):
        if (reason := _refusal(om_class, config, **layout)) is not None:
            refused[name] = reason
            return None
        model = om_class.from_pretrained(path, parallel=om.ParallelConfig(**layout), progress=False).train()
        if layout.get("pipeline_parallel_size", 1) > 1:
            batch = _batch(config, seq=8)
            if _is_moe(config):  # the load-balancing loss is per replica: both replicas get the same rows
                batch = {key: torch.cat([value[:2], value[:2]]) for key, value in batch.items()}
            return assert_pipeline_matches(model, _reference(model_type, path), batch, steps=1)
        return train_matches(model, _reference(model_type, path), _batch(config), zero_stage=zero_stage)

    # tp = 2 with sequence parallelism x dp = 2 under ZeRO-3, then (trained, sharded weights) a cached decode loop
    # and generate
    pair = run("tp2+sp x dp2 zero3", 3, tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2)
    if pair is None:  # a family refusing sequence parallelism: tp = 2 alone
        pair = run("tp2 x dp2 zero3", 3, tensor_parallel_size=2, data_parallel_size=2)
    _check_decode_loop(*pair)
    _check_generate(*pair)
    run("tp4", tensor_parallel_size=4)
    # 1F1B with 2 microbatches (the MoE decoders: GPipe with one, where their load-balancing loss is the batch's)
    schedule = dict(pipeline_schedule="gpipe", num_microbatches=1) if _is_moe(config) else dict(num_microbatches=2)
    schedule["pipeline_partition"] = "parameters"  # odd layer counts too
    if run("pp2 x tp2", pipeline_parallel_size=2, tensor_parallel_size=2, **schedule) is None and _is_moe(config):
        run("pp2 x dp2", pipeline_parallel_size=2, data_parallel_size=2, **schedule)
    # the all-to-all mode is family-independent past the heads rule: tests/parallel_layers/test_context_parallel.py
    run("cp2 ring x dp2 zero1", 1, context_parallel_size=2, context_parallel_mode="ring", data_parallel_size=2)
    _assert_refusals(model_type, refused)


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
    _check_save_load(model, reference, tmp_path / "saved")
    _check_activation_checkpointing(model_type, path)
    if model_type != TOY_TYPE:  # the throwaway family is Llama's code under another name
        run_distributed(_layouts_worker, 4, model_type, path)


def test_throwaway_family_is_a_record_and_a_spec(toy_registered):
    """The declared family goes through the Auto classes, derives its plan from the spec and refuses bad sizes."""
    config = ToyConfig(**TOY.tiny_config)
    model = om.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "ToyForCausalLM" and type(model.model).__name__ == "ToyModel"
    assert model.parallel_plan.styles.keys() == om.LlamaForCausalLM.parallel_plan.styles.keys()
    assert type(model).pipeline_adapter().layer_paths == ("model.layers",)
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=3))
