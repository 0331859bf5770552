"""GPT-NeoX, GPT-J and Phi beyond the zoo's causal-LM parity (``tests/models/test_zoo.py`` runs their records' tiny
models: GPT-NeoX with parallel residual, Phi with q/k layer norms and grouped-query heads, GPT-J with interleaved
partial rotary; all three with partial rotary), against single-process ``transformers`` from the same weights:

- tp=1: the other switches (GPT-NeoX ``use_parallel_residual=False``, Phi ``qk_layernorm=False``) and every head
  class (keys, outputs, loss, every gradient); every dropout on in training mode, bit for bit with the same seed
  (each dropout sits where ``transformers`` has it); greedy ``generate`` with left padding token for token;
  ``save_pretrained`` -> plain ``transformers`` gives the same logits (GPT-NeoX writes ``embed_out.weight``, as
  ``transformers`` does); the published ``base_model_tp_plan`` holds ``transformers``' own entries; the fused
  kernels (forced, Triton interpreter) equal the reference path;
- one spawned group of 2 ranks: tp=2 + sequence parallelism for the switches and every head; greedy and sampled
  ``generate`` with left padding; ``save_pretrained`` at tp=2 (gathered per head) loaded by ``transformers``; context
  parallelism (cp=2, ring and all-to-all): loss, this rank's logits and every gradient;
- negative controls, one per new component: GPT-J's rotary as halves instead of interleaved pairs, GPT-NeoX's
  ``query_key_value`` cut as three packed blocks (GPT-2's split), Phi's per-head q/k layer norms without their
  tensor-parallel gradient sum, and GPT-NeoX's checkpoint without the ``embed_out`` renaming all fail.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors import safe_open

import oslo_models as om
from oslo_models import training
from oslo_models.data import ContextParallelSplitter
from oslo_models.fused_ops._utils import HAS_TRITON, interpreter_enabled
from oslo_models.models.registry import family_record
from oslo_models.parallel_layers.context_parallel import split_sequence
from oslo_models.parallel_layers.plan import Colwise, ParallelPlan, SequenceParallelNorm
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.zoo import tiny_config

TYPES = ("gpt_neox", "gptj", "phi")
# the switch each record leaves at its other value
SWITCHES = (("gpt_neox", dict(use_parallel_residual=False)), ("phi", dict(qk_layernorm=False)))
VOCAB = 101
PROMPT = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
PROMPT_MASK = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
GREEDY = dict(attention_mask=PROMPT_MASK, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


def _pair(model_type: str, task: str = "causal_lm", *, parallel=None, seed: int = 0, model_class=None,
          **overrides):
    """(ours via ``from_config``, ``transformers``' twin) drawn from the same seed, both in training mode."""
    config = tiny_config(model_type, **overrides)
    cls = model_class or family_record(model_type).model_class(task)
    torch.manual_seed(seed)
    reference = cls.hf_twin(config).train()
    torch.manual_seed(seed)
    return cls.from_config(config, parallel=parallel).train(), reference


def _outputs(model, task: str, ids, mask, labels):
    """The task's outputs to compare, and the scalar to differentiate."""
    if task == "base":
        out = model(ids, attention_mask=mask)
        return [out.last_hidden_state], out.last_hidden_state.pow(2).mean()
    if task == "question_answering":
        out = model(ids, attention_mask=mask, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([4, 9]))
        return [out.start_logits, out.end_logits, out.loss], out.loss
    if task == "sequence_classification":
        labels = torch.tensor([0, 2])
    elif task == "token_classification":
        labels = labels.clamp(max=2)
    out = model(ids, attention_mask=mask, labels=labels)
    return [out.logits, out.loss], out.loss


def _check_task(model, reference, task: str) -> None:
    """Keys, outputs, loss and every gradient of one head on a right-padded batch."""
    assert set(model.state_dict()) == set(reference.state_dict()), task
    ids, mask, labels = padded_batch(VOCAB, batch=2, seq=8)
    if task == "token_classification":  # its classifier dropout draws differently: compare without it
        model.eval(), reference.eval()
    expected, expected_scalar = _outputs(reference, task, ids, mask, labels)
    got, scalar = _outputs(model, task, ids, mask, labels)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"{task}: {m}")
    expected_scalar.backward(), scalar.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


# ---------------------------------------------------------------------------------------------- tp=1
@pytest.mark.parametrize("model_type", TYPES)
def test_every_head_and_switch_matches_transformers(model_type):
    for task in family_record(model_type).classes:
        _check_task(*_pair(model_type, task, num_labels=3), task)
    for switch_type, overrides in SWITCHES:
        if switch_type == model_type:
            _check_task(*_pair(model_type, **overrides), "causal_lm")


DROPOUTS = {"gpt_neox": dict(hidden_dropout=0.2, attention_dropout=0.2),
            "gptj": dict(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2),
            "phi": dict(resid_pdrop=0.2, embd_pdrop=0.2, attention_dropout=0.2)}


@pytest.mark.parametrize("model_type", TYPES)
def test_dropouts_draw_as_transformers(model_type):
    """Every dropout on, training mode, the same seed: the same masks in the same order, so the logits are equal
    (and differ from another seed's)."""
    variants = [DROPOUTS[model_type]]
    if model_type == "gpt_neox":  # the sequential block's dropouts too
        variants.append(dict(DROPOUTS[model_type], use_parallel_residual=False))
    for extra in variants:
        model, reference = _pair(model_type, **extra)
        ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
        torch.manual_seed(5)
        expected = reference(ids, labels=ids).logits
        torch.manual_seed(5)
        torch.testing.assert_close(model(ids, labels=ids).logits, expected, atol=1e-5, rtol=1e-4)
        torch.manual_seed(6)
        assert not torch.allclose(model(ids).logits, expected, atol=1e-3)


@pytest.mark.parametrize("model_type", TYPES)
def test_greedy_generate_left_padded_and_save_load_in_transformers(model_type, tmp_path):
    model, reference = _pair(model_type)
    model.eval(), reference.eval()
    ours, theirs = model.generate(PROMPT, **GREEDY), reference.generate(PROMPT, **GREEDY)
    assert ours.shape == (2, 14) and torch.equal(ours, theirs), (ours, theirs)

    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(reference)
    ids = torch.randint(3, VOCAB, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as stored:
        keys = set(stored.keys())
    if model_type == "gpt_neox":  # transformers' own save writes embed_out too
        assert "embed_out.weight" in keys and "lm_head.weight" not in keys
    else:
        assert "lm_head.weight" in keys and "lm_head.bias" in keys  # GPT-J and Phi: a biased head


def test_gpt_neox_embed_out_checkpoints_need_the_renaming(tmp_path):
    """A ``transformers``-saved checkpoint (``embed_out.weight``) loads whole; without the renaming (negative
    control) the head would be missing and newly initialized."""
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(tiny_config("gpt_neox")).save_pretrained(tmp_path)
    _, info = om.GPTNeoXForCausalLM.from_pretrained(tmp_path, output_loading_info=True, progress=False)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    _, info = _NoRenaming.from_pretrained(tmp_path, output_loading_info=True, progress=False)
    assert info["missing_keys"] == {"lm_head.weight"} and info["unexpected_keys"] == {"embed_out.weight"}


class _NoRenaming(om.GPTNeoXForCausalLM):
    hub_key_renames = ()


def test_gptj_half_rotation_does_not_match():
    """Negative control: GPT-J's rotary as the NeoX/Llama halves instead of interleaved pairs must fail."""
    model, reference = _pair("gptj")
    ids = torch.randint(3, VOCAB, (2, 8))
    expected = reference(ids).logits
    torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-4)
    for block in model.transformer.h:
        block.attn.interleaved_rotary = False
    assert not torch.allclose(model(ids).logits, expected, atol=1e-3)


def test_published_tensor_parallel_plans():
    for model_type in TYPES:
        ours = family_record(model_type).config_class().base_model_tp_plan
        theirs = transformers.CONFIG_MAPPING[model_type].base_model_tp_plan
        assert {key: ours[key] for key in theirs} == theirs, model_type
    assert om.GPTNeoXConfig.base_model_tp_plan["layers.*.attention.query_key_value"] == "colwise"  # whole heads


@pytest.mark.skipif(not (HAS_TRITON and interpreter_enabled()),
                    reason="needs triton with TRITON_INTERPRET=1 set before import")
@pytest.mark.parametrize("model_type", TYPES)
def test_fused_kernels_equal_reference(model_type, monkeypatch):
    """Layer norms (Phi's per-head q/k norms too), the half-layout rotary (not GPT-J's interleaved one) and
    bias-GELU run fused (forced, Triton interpreter); loss and every gradient equal the reference path."""
    ids, mask, labels = padded_batch(VOCAB, batch=2, seq=8)

    def run(fused: bool):
        monkeypatch.setenv("OSLO_FUSED_OPS", "force" if fused else "0")
        torch.manual_seed(0)
        model = family_record(model_type).model_class("causal_lm").from_config(
            tiny_config(model_type), parallel=om.ParallelConfig(fused_ops=fused))
        out = model.train()(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}

    loss_off, grads_off = run(False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        loss_on, grads_on = run(True)
    ran = {event.key for event in profile.key_averages()}
    assert {"oslo_models::layer_norm", "oslo_models::bias_gelu"} <= ran
    assert ("oslo_models::rotary_embedding" in ran) == (model_type != "gptj")
    torch.testing.assert_close(loss_on, loss_off, atol=1e-5, rtol=1e-5)
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------- 2 ranks
class _GPT2StyleSplit(om.GPTNeoXForCausalLM):
    """``query_key_value`` cut as three packed blocks ``[3, n, d]`` (GPT-2's ``c_attn`` split): wrong here."""

    parallel_plan = ParallelPlan({**om.GPTNeoXForCausalLM.parallel_plan.styles,
                                  "gpt_neox.layers.*.attention.query_key_value": Colwise(num_packed=3)})


class _UnsummedHeadNorms(om.PhiForCausalLM):
    """Phi's q/k layer norms as residual-stream norms: their gradients are summed over TP only under SP."""

    parallel_plan = ParallelPlan({**om.PhiForCausalLM.parallel_plan.styles,
                                  "model.layers.*.self_attn.q_layernorm": SequenceParallelNorm(),
                                  "model.layers.*.self_attn.k_layernorm": SequenceParallelNorm()})


def _check_context_parallel(model_type: str, mode: str) -> None:
    model, reference = _pair(model_type, parallel=om.ParallelConfig(context_parallel_size=2,
                                                                    context_parallel_mode=mode))
    context = model.parallel_context
    # the wrapper sums each rank's gradient (of its chunks) over cp, as training does
    wrapped, _ = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters()))
    ids, mask, labels = padded_batch(VOCAB, batch=2, seq=16)
    full = dict(input_ids=ids, attention_mask=mask, labels=labels)
    expected = reference(**full)
    got = wrapped(**ContextParallelSplitter(context, shift_labels=True)(full))
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, split_sequence(expected.logits, context.cp_rank, context.cp_size, mode),
                               atol=1e-5, rtol=1e-4)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def _two_rank_worker(root: str) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    for model_type, overrides in SWITCHES:  # the other switch at tp=2 + SP
        _check_task(*_pair(model_type, parallel=parallel, **overrides), "causal_lm")
    for model_type in TYPES:
        for task in family_record(model_type).classes:
            if task != "causal_lm":  # the zoo runs the causal LM at tp=2 + SP
                _check_task(*_pair(model_type, task, parallel=parallel, num_labels=3), task)
        model, reference = _pair(model_type, parallel=parallel)
        model.eval(), reference.eval()
        ours, theirs = model.generate(PROMPT, **GREEDY), reference.generate(PROMPT, **GREEDY)
        assert torch.equal(ours, theirs), (model_type, ours, theirs)
        sampling = dict(GREEDY, do_sample=True, top_k=20, temperature=0.8)
        torch.manual_seed(11)
        theirs = reference.generate(PROMPT, **sampling)
        torch.manual_seed(11)
        assert torch.equal(model.generate(PROMPT, **sampling), theirs), model_type
        model.save_pretrained(f"{root}/{model_type}")  # gathered: loaded by transformers in the main process

    for model_type in TYPES:
        _check_context_parallel(model_type, "ring")
    _check_context_parallel("gpt_neox", "all_to_all")

    # negative controls
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    model, reference = _pair("gpt_neox", parallel=parallel, model_class=_GPT2StyleSplit)
    assert not torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-3)
    # no SP: only the head norms' own style sums their gradients (right, then wrong)
    plain_tp = om.ParallelConfig(tensor_parallel_size=2)
    _check_task(*_pair("phi", parallel=plain_tp), "causal_lm")
    model, reference = _pair("phi", parallel=plain_tp, model_class=_UnsummedHeadNorms)
    out, expected = model(ids, labels=ids), reference(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected.logits, atol=1e-5, rtol=1e-4)  # the forward is right
    out.loss.backward(), expected.loss.backward()
    with pytest.raises(AssertionError, match="q_layernorm"):
        assert_grads_match(model, reference)


def test_tp2_heads_switches_generate_save_and_cp2_match_transformers(tmp_path):
    run_distributed(_two_rank_worker, 2, str(tmp_path), timeout=900)
    ids = torch.randint(3, VOCAB, (2, 8))
    for model_type in TYPES:
        torch.manual_seed(0)
        reference = family_record(model_type).model_class("causal_lm").hf_twin(tiny_config(model_type)).eval()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / model_type).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, atol=1e-6, rtol=1e-6)
