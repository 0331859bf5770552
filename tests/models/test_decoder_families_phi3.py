"""Phi-3, StarCoder2 and Qwen3-MoE beyond the zoo (``tests/models/test_zoo.py`` runs their records' tiny models:
tp 1, tp 2 (+SP for the dense two), the decode loop and pp 2), against ``transformers`` (fp32, atol 1e-5):

- tp 1: greedy ``generate`` with left padding token for token (Phi-3 crossing ``original_max_position_embeddings``,
  where ``transformers`` drops the short-factor cache once); the residual / embedding dropouts drawn in
  ``transformers``' order; every head (sequence / token classification, Qwen3-MoE's question answering under
  ``transformer``); the MoE base model's router logits; Qwen3-MoE with ``decoder_sparse_step=2``; Phi-3's rotary;
- one spawned group of 2: at tp 2, Phi-3's packed q|k|v attention split (key/value heads split, then replicated)
  against the single-process module with its negative controls; the dropout RNG rules of the new dropout sites (SP
  off and on); Phi-3 with 2 key/value heads at tp 2 + SP; gradient-norm clipping with replicated key/value blocks;
  ``save_pretrained`` at tp 2 opening in plain ``transformers``; context parallelism (cp 2, ring, one AdamW step)
  with Phi-3's longrope switching inside the sequence and StarCoder2's window;
- one spawned group of 4: Qwen3-MoE at ep 2 x tp 2 and ep 4 (logits, router logits, aux loss, loss, every gradient,
  clipping, parameters after 3 AdamW steps; the MoE parity test's helper), the ep 2 x tp 2 save in ``transformers``.

Each new component has a negative control: a naive split of the packed q|k|v and a missing replica-gradient sum
fail; a model without its residual dropouts fails; the full-width rotary on a partial-rotary config fails; a summed
instead of per-block clipping share fails; keeping the short-factor cache past the switch changes the logits; a
context-parallel rank's own positions alone pick other longrope factors than the whole sequence.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file
from transformers.models.phi3.modeling_phi3 import Phi3Attention, Phi3RotaryEmbedding

import oslo_models as om
from oslo_models.models.common import PackedQKVAttention, PartialRotaryEmbedding, RotaryEmbedding
from oslo_models.models.common.stack.context_parallel import rotary_embeddings
from oslo_models.parallel_layers.sharding import EvenSplit
from oslo_models.training import clip_grad_norm_
from tests.helpers import zoo
from tests.helpers.dist import run_distributed
from tests.helpers.dropout import DropoutMasks, check_tp_rules
from tests.helpers.models import assert_grads_match, padded_batch
from tests.models.test_components import _attention_call, _attn_config, _check_split, _parallel_copy, _randomize, _x

ATOL = dict(atol=1e-5, rtol=1e-5)
TYPES = ("phi3", "starcoder2", "qwen3_moe")
HF = {"phi3": "Phi3", "starcoder2": "Starcoder2", "qwen3_moe": "Qwen3Moe"}


def _classes(model_type: str, head: str):
    prefix = HF[model_type]
    return getattr(om, prefix + head), getattr(transformers, prefix + head)


def _pair(model_type: str, head: str = "ForCausalLM", *, parallel=None, seed: int = 0, **overrides):
    """(ours via ``from_config``, ``transformers``' twin) drawn from the same seed; one config object each (a
    ``transformers`` MoE model marks its config with an experts implementation ours would be asked to take)."""
    ours, theirs = _classes(model_type, head)
    torch.manual_seed(seed)
    reference = theirs(zoo.tiny_config(model_type, **overrides))
    torch.manual_seed(seed)
    model = ours.from_config(zoo.tiny_config(model_type, **overrides), parallel=parallel)
    return model, reference


def _vocab(model_type: str) -> int:
    return zoo.tiny_kwargs(model_type)["vocab_size"]


# ---------------------------------------------------------------------------------------------- tp 1
@pytest.mark.parametrize("model_type", TYPES)
def test_greedy_generate_left_padded_matches_transformers(model_type):
    """Phi-3's prompt of 6 (its original length) grows past it: ``transformers`` drops the cache once and
    recomputes with the long factors; so must we, or the tokens differ."""
    model, reference = _pair(model_type)
    model.eval(), reference.eval()
    prompt = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
    mask = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
    greedy = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
    if model_type == "qwen3_moe":  # transformers' aux loss cannot take a decode step's mask: it fails, so does ours
        greedy["output_router_logits"] = False
    ours, theirs = model.generate(prompt, **greedy), reference.generate(prompt, **greedy)
    assert ours.shape == (2, 12) and torch.equal(ours, theirs), (ours, theirs)


def test_phi3_cache_switch_matters():
    """The control of the test above: a decode step past ``original_max_position_embeddings`` on the short-factor
    cache is not the recomputed sequence, and ``prepare_inputs_for_generation`` drops the cache exactly there."""
    model, _ = _pair("phi3")
    model.eval()
    original = model.config.original_max_position_embeddings
    ids = torch.randint(3, _vocab("phi3"), (1, original + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        model(ids[:, :original], past_key_values=cache)
        stale = model(ids[:, original:], past_key_values=cache).logits[:, -1]
        fresh = model(ids).logits[:, -1]
    assert not torch.allclose(stale, fresh, atol=1e-3)
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :original], past_key_values=cache)
    assert model.prepare_inputs_for_generation(ids, cache=cache).get("cache") is None  # crosses: recompute
    assert model.prepare_inputs_for_generation(ids[:, :original], cache=cache).get("cache") is cache


@pytest.mark.parametrize("model_type,overrides", [
    ("phi3", dict(resid_pdrop=0.3)),
    ("starcoder2", dict(residual_dropout=0.3, embedding_dropout=0.2)),
])
def test_dropouts_draw_as_transformers(model_type, overrides):
    """Training mode with the dropouts on: seeded alike, our residual / embedding dropouts draw the same masks in
    the same order as ``transformers`` (tp 1), so logits and gradients are equal; without them (p=0 on ours: the
    negative control) they are not."""
    model, reference = _pair(model_type, **overrides)
    model.train(), reference.train()
    ids, mask, labels = padded_batch(_vocab(model_type), batch=2, seq=8)
    torch.manual_seed(7)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    torch.manual_seed(7)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, **ATOL)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch.manual_seed(7)
    assert not torch.allclose(model(input_ids=ids, attention_mask=mask).logits, expected.logits, atol=1e-3)


@pytest.mark.parametrize("model_type,head", [(t, h) for t in TYPES for h in
                                             ("ForSequenceClassification", "ForTokenClassification")]
                         + [("qwen3_moe", "ForQuestionAnswering")])
def test_heads_match_transformers(model_type, head):
    model, reference = _pair(model_type, head, num_labels=3)
    assert set(model.state_dict()) == set(reference.state_dict())
    model.eval(), reference.eval()
    ids, mask, _ = padded_batch(_vocab(model_type), batch=3, seq=8)
    if head == "ForQuestionAnswering":
        labels = dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([4, 5, 9]))
        keys = ("start_logits", "end_logits", "loss")
    else:
        labels = dict(labels=torch.tensor([0, 2, 1]) if head == "ForSequenceClassification"
                      else torch.randint(0, 3, ids.shape, generator=torch.Generator().manual_seed(2)))
        keys = ("logits", "loss")
    got, expected = model(ids, attention_mask=mask, **labels), reference(ids, attention_mask=mask, **labels)
    for key in keys:
        torch.testing.assert_close(got[key], expected[key], **ATOL)


def test_qwen3_moe_sparse_step_and_base_router_logits():
    """``decoder_sparse_step=2`` (layers 1 and 3 sparse, 0 and 2 dense), no top-k renormalization: the layer kinds,
    logits, router logits and aux loss of ``transformers``; the base model returns the router logits too."""
    overrides = dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False)
    model, reference = _pair("qwen3_moe", **overrides)
    assert [layer.is_sparse for layer in model.model.layers] == [False, True, False, True]
    assert [type(layer.mlp).__name__ for layer in reference.model.layers] == [
        "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    ids, mask, labels = padded_batch(_vocab("qwen3_moe"))
    got, expected = model(ids, attention_mask=mask, labels=labels), reference(ids, attention_mask=mask, labels=labels)
    for key in ("logits", "aux_loss", "loss"):
        torch.testing.assert_close(got[key], expected[key], **ATOL)
    assert len(got.router_logits) == 2
    for mine, theirs in zip(got.router_logits, expected.router_logits, strict=True):
        torch.testing.assert_close(mine, theirs, **ATOL)
    base, reference_base = _pair("qwen3_moe", "Model", **overrides)
    got, expected = base(ids, attention_mask=mask), reference_base(ids, attention_mask=mask)
    assert type(got) is type(expected) and len(got.router_logits) == len(expected.router_logits) == 2
    torch.testing.assert_close(got.router_logits[1], expected.router_logits[1], **ATOL)
    assert base(ids, output_router_logits=False).router_logits is None


def test_phi3_rotary_is_transformers_own():
    """``PartialRotaryEmbedding`` is Phi-3's rotary for longrope (short and long factors) and a partial default; the
    full-width Llama rotary (the negative control) is not, on the partial default."""
    config = zoo.tiny_config("phi3")
    x = torch.zeros(1, 12, config.hidden_size)
    ours, theirs = PartialRotaryEmbedding(config), Phi3RotaryEmbedding(config)
    cos_by_length = []
    for positions in (torch.arange(4)[None], torch.arange(12)[None]):  # below and past the original 6
        for mine, reference in zip(ours(x, positions), theirs(x, positions)):
            torch.testing.assert_close(mine, reference, atol=0, rtol=0)
        cos_by_length.append(ours(x, positions)[0][:, :4])
    assert cos_by_length[0].shape[-1] == 4 and not torch.allclose(*cos_by_length)  # short and long factors act
    config = zoo.tiny_config("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.5})
    positions = torch.arange(8)[None]
    cos, _ = PartialRotaryEmbedding(config)(x, positions)
    torch.testing.assert_close(cos, Phi3RotaryEmbedding(config)(x, positions)[0], atol=0, rtol=0)
    assert RotaryEmbedding(config)(x, positions)[0].shape != cos.shape


def test_packed_attention_matches_phi3_attention():
    config = _attn_config(transformers.Phi3Config, num_key_value_heads=1)
    torch.manual_seed(0)
    theirs = _randomize(Phi3Attention(config, 0), std=0.5)
    ours = PackedQKVAttention(config, 0)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    call = _attention_call(config)
    torch.testing.assert_close(call(ours, _x()), call(theirs, _x()), **ATOL)


def test_clear_errors_before_any_process_group():
    """Query heads that do not split are a ``ValueError`` from the config alone; one key/value head at tp 2 or 4 is
    replicated, not refused; the grid modes refuse the packed q|k|v (their layers split packed outputs evenly)."""
    config = zoo.tiny_config("phi3")
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        om.Phi3ForCausalLM.validate_parallel_config(config, om.ParallelConfig(tensor_parallel_size=3))
    for tp in (2, 4):
        om.Phi3ForCausalLM.validate_parallel_config(config, om.ParallelConfig(tensor_parallel_size=tp))

    class Grid:
        tensor_parallel_mode, is_grid = "2d", True

    attention = PackedQKVAttention(_attn_config(transformers.Phi3Config), 0)
    with pytest.raises(NotImplementedError, match="packed q|k|v"):
        PackedQKVAttention.tp_plan["qkv_proj"].build(attention.qkv_proj, Grid())
    with pytest.raises(ValueError, match="no q/k norms"):
        PackedQKVAttention(_attn_config(transformers.Phi3Config), 0, qk_norm=True)


# ---------------------------------------------------------------------------------------------- tp 2
def _packed_attention_split(ctx) -> None:
    """The split packed q|k|v attention equals the single-process one (output, input and parameter gradients), with
    key/value heads split (n_kv=2) and replicated (n_kv=1); a naive even split of the packed rows, and (replicated)
    a missing sum of the key/value copies' gradients, fail."""
    for kv_heads in (2, 1):
        config = _attn_config(transformers.Phi3Config, num_key_value_heads=kv_heads)
        torch.manual_seed(0)
        plain = _randomize(PackedQKVAttention(config, 0), std=0.5)
        call = _attention_call(config)
        module, out = _check_split(plain, ctx, call)
        assert module.qkv_proj.blocks == [16, 8 * max(kv_heads // 2, 1), 8 * max(kv_heads // 2, 1)]
        naive = EvenSplit(0).read_shard(tuple(plain.qkv_proj.weight.shape), plain.qkv_proj.weight.detach().__getitem__,
                                        ctx.tp_rank, ctx.tp_size)
        if naive.shape == module.qkv_proj.weight.shape:
            wrong, _ = _parallel_copy(plain, ctx, PackedQKVAttention.tp_plan)
            with torch.no_grad():
                wrong.qkv_proj.weight.copy_(naive)
            assert not torch.allclose(call(wrong, _x()), out, atol=1e-3)
        if kv_heads == 1:
            unsummed, _ = _parallel_copy(plain, ctx, PackedQKVAttention.tp_plan)
            unsummed.qkv_proj.replica_groups = [None, None, None]
            call(unsummed, _x()).pow(2).sum().backward()
            summed, _ = _parallel_copy(plain, ctx, PackedQKVAttention.tp_plan)
            call(summed, _x()).pow(2).sum().backward()
            query_rows = summed.qkv_proj.blocks[0]
            torch.testing.assert_close(unsummed.qkv_proj.weight.grad[:query_rows],
                                       summed.qkv_proj.weight.grad[:query_rows], **ATOL)
            assert not torch.allclose(unsummed.qkv_proj.weight.grad[query_rows:],
                                      summed.qkv_proj.weight.grad[query_rows:], atol=1e-4)


def _dropout_rules() -> None:
    """The tensor-parallel RNG rules (``tests/models/test_tp_dropout_rng.py``) on the new dropout sites: residual
    and embedding dropouts drop the whole stream alike on both ranks, or (SP) each rank its own chunk; attention
    probabilities of each rank's heads differ."""
    p = 0.2
    cases = {"phi3": (dict(resid_pdrop=p, attention_dropout=p), {r"model\.layers\.\d+\.resid_(attn|mlp)_dropout"}),
             "starcoder2": (dict(residual_dropout=p, embedding_dropout=p, attention_dropout=p),
                            {r"model\.embedding_dropout", r"model\.layers\.\d+\.attn_residual_dropout",
                             r"model\.layers\.\d+\.mlp\.dropout"})}
    ids, mask, labels = padded_batch(_vocab("phi3"), batch=2, seq=8)
    for model_type, (overrides, residual) in cases.items():
        for sp in (False, True):
            parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=sp)
            torch.manual_seed(0)
            model = _classes(model_type, "ForCausalLM")[0].from_config(zoo.tiny_config(model_type, **overrides),
                                                                       parallel=parallel).train()
            with DropoutMasks(model) as recorder:
                model(ids, attention_mask=mask, labels=labels)
            rules = {pattern: "split" if sp else "replicated" for pattern in residual}
            check_tp_rules(recorder.masks, {**rules, r"model\.layers\.\d+\.self_attn": "split"},
                           what=f"{model_type} tp=2 sp={sp}")


def _tp2_worker(paths: dict, out_root: str) -> None:
    from tests.parallel_layers.test_context_parallel import _train_matches as context_parallel_step_matches

    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    _packed_attention_split(ctx)
    _dropout_rules()
    # context parallelism (ring, one AdamW step): Phi-3's longrope switching inside the sequence, StarCoder2's window
    for name in ("phi3_longrope12", "starcoder2"):
        context_parallel_step_matches(name.split("_")[0], paths[name], context_parallel_size=2, steps=1)
    # the control: a rank's own positions alone (4..11 on cp rank 1) would pick the short factors
    model = om.Phi3ForCausalLM.from_pretrained(paths["phi3_longrope12"], parallel=om.ParallelConfig(
        context_parallel_size=2), progress=False)
    rotary, cp_rank = model.model.rotary_emb, model.parallel_context.cp_rank
    x, mine = torch.zeros(1, 16, 64), (torch.arange(12, 16) if cp_rank == 0 else torch.arange(4, 12))[None]
    cos = rotary_embeddings(model.model, rotary, x, mine)[0]
    torch.testing.assert_close(cos, rotary(x, torch.arange(16)[None])[0][:, mine[0]], atol=0, rtol=0)
    assert cp_rank == 0 or not torch.allclose(rotary(x, mine)[0], cos, atol=1e-3)
    ids, mask, labels = padded_batch(zoo.tiny_kwargs("phi3")["vocab_size"], batch=2, seq=8)
    # Phi-3 with q|k|v blocks of 8|2|2 heads (split, not replicated; the zoo's record replicates 1) at tp 2 + SP
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    model = om.Phi3ForCausalLM.from_pretrained(paths["phi3_kv2"], parallel=parallel, progress=False).train()
    reference = transformers.Phi3ForCausalLM.from_pretrained(paths["phi3_kv2"]).train()
    assert model.model.layers[0].self_attn.qkv_proj.blocks == [32, 8, 8]
    got, expected = model(ids, attention_mask=mask, labels=labels), reference(ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, **ATOL)
    got.loss.backward(), expected.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))
    # gradient-norm clipping with the key/value blocks replicated on both ranks: counted once each
    for model_type in ("phi3", "starcoder2"):
        parallel = om.ParallelConfig(tensor_parallel_size=2)
        model = om.AutoModelForCausalLM.from_pretrained(paths[model_type], parallel=parallel, progress=False).train()
        reference = transformers.AutoModelForCausalLM.from_pretrained(paths[model_type]).train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        reference(ids, attention_mask=mask, labels=labels).loss.backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        if model_type == "phi3":  # the control: the packed weight's local square sum counted as one share
            plan = model.parallel_plan
            naive = torch.zeros(())
            for name, param in model.named_parameters():
                spec = plan.shard_spec(model, name)
                share = param.grad.pow(2).sum() / (1 if spec.split else ctx.tp_size)
                naive = naive + share
            dist.all_reduce(naive, group=ctx.tp_group)
            assert not torch.allclose(naive.sqrt(), expected_norm, atol=1e-4)
        torch.testing.assert_close(clip_grad_norm_(model, 0.5), expected_norm, **ATOL)
        # save at tp 2 -> plain transformers: its keys and shapes, the same logits
        model.eval()
        logits = model(ids, attention_mask=mask).logits
        out = os.path.join(out_root, model_type)
        model.save_pretrained(out)
        if dist.get_rank() == 0:
            plain = transformers.AutoModelForCausalLM.from_pretrained(out)
            assert type(plain).__name__ == type(model).__name__
            saved, original = load_file(os.path.join(out, "model.safetensors")), load_file(
                os.path.join(paths[model_type], "model.safetensors"))
            assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
            torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, **ATOL)


def _save(path, model_type: str, **overrides) -> str:
    torch.manual_seed(0)
    _classes(model_type, "ForCausalLM")[1](zoo.tiny_config(model_type, **overrides)).save_pretrained(path)
    return str(path)


# Phi-3 whose long factors take over past 12 positions: in the context-parallel test's 16-token rows, but not in
# every rank's chunk (positions 4..11 on cp rank 1), so each rank must pick the frequencies of the whole sequence
LONGROPE_12 = dict(original_max_position_embeddings=12, rope_parameters={
    **zoo.tiny_kwargs("phi3")["rope_parameters"], "original_max_position_embeddings": 12})


def test_tp2_cp2_packed_attention_clipping_and_save(tmp_path):
    paths = {"phi3": _save(tmp_path / "phi3", "phi3"),
             "phi3_kv2": _save(tmp_path / "phi3_kv2", "phi3", num_key_value_heads=2),
             "phi3_longrope12": _save(tmp_path / "phi3_longrope12", "phi3", **LONGROPE_12),
             "starcoder2": _save(tmp_path / "starcoder2", "starcoder2")}
    run_distributed(_tp2_worker, 2, paths, str(tmp_path / "saved"), timeout=600)


# ---------------------------------------------------------------------------------------------- ep
def _expert_parallel_worker(path: str, out_root: str) -> None:
    from tests.models.test_moe_parity import _resident_experts_are_own, _train_matches

    for ep, tp in ((2, 2), (4, 1)):
        parallel = om.ParallelConfig(expert_parallel_size=ep, tensor_parallel_size=tp)
        model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, progress=False).train()
        ctx = model.parallel_context
        assert type(model).__name__ == "Qwen3MoeForCausalLM" and (ctx.ep_size, ctx.tp_size) == (ep, tp)
        _resident_experts_are_own(model)
        reference = transformers.Qwen3MoeForCausalLM.from_pretrained(path).train()
        _train_matches(model, reference, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)
        if tp == 1:
            continue
        model.eval()
        ids, mask, _ = padded_batch(zoo.tiny_kwargs("qwen3_moe")["vocab_size"])
        logits = model(ids, attention_mask=mask).logits
        out = os.path.join(out_root, f"ep{ep}-tp{tp}")
        model.save_pretrained(out)
        if dist.get_rank() == 0:
            plain = transformers.Qwen3MoeForCausalLM.from_pretrained(out)
            saved, original = load_file(os.path.join(out, "model.safetensors")), load_file(
                os.path.join(path, "model.safetensors"))
            assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
            torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, **ATOL)


def test_qwen3_moe_expert_parallel_matches_transformers(tmp_path):
    run_distributed(_expert_parallel_worker, 4, _save(tmp_path / "qwen3_moe", "qwen3_moe"), str(tmp_path / "saved"),
                    timeout=600)
