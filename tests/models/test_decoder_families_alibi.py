"""OPT, Bloom and Falcon beyond the zoo (``tests/models/test_zoo.py`` runs each record's tiny model: OPT pre-norm with
``word_embed_proj_dim`` projections, Bloom with 12 ALiBi heads, Falcon's new architecture with 2 key/value groups).

The other architecture switches, each against single-process ``transformers`` from the same weights (fp32, atol
1e-5) at tp=1 here and at tp=2 + sequence parallelism in one spawned group: logits, loss and every gradient on a
left-padded batch, a decode loop on the cache, greedy ``generate`` with left padding token for token (and a pipeline
step for OPT's post-norm):

- OPT post-norm (``do_layer_norm_before=False``: no final norm, no projections);
- Bloom with ``apply_residual_connection_post_layernorm``;
- Falcon multi-query (one key/value head, replicated over tp) with a parallel and with a sequential block, per-head
  ``[q, k, v]`` with ALiBi on 12 heads (not a power of two), the new architecture with one key/value group (its
  key/value head replicated within the group at tp 2), one shared norm and ALiBi.

Also: every head class against ``transformers`` (keys and outputs); ``save_pretrained`` at tp 2 -> plain
``transformers`` ``from_pretrained`` gives the same logits; context parallelism for the rotary Falcon and OPT (ALiBi
under cp: ``tests/parallel_layers/test_context_parallel_score_mods.py``); the head-count errors before any process
group. Negative controls: the slopes of the wrong rank, a naive column split of a fused ``query_key_value``, a
residual taken before the norm, OPT positions that ignore the padding: each fails to match.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.common.attention.cache_names import cache_kwargs
from oslo_models.models.common.embeddings.positions import alibi_attention_mask, alibi_slopes, local_alibi_slopes
from oslo_models.parallel_layers.grouped_qkv import GroupedQKVSplit
from oslo_models.parallel_layers.sharding import PackedSplit
from oslo_models.training.clip import grad_norm
from tests.helpers import zoo
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match
from tests.helpers.pipeline import assert_pipeline_matches

PREFIX = {"opt": "OPT", "bloom": "Bloom", "falcon": "Falcon"}
VARIANTS = {
    "opt_post_norm": ("opt", dict(do_layer_norm_before=False, word_embed_proj_dim=64)),
    "bloom_residual_post_ln": ("bloom", dict(apply_residual_connection_post_layernorm=True)),
    "falcon_mqa_parallel": ("falcon", dict(new_decoder_architecture=False, multi_query=True, bias=False)),
    "falcon_mqa_sequential": ("falcon", dict(new_decoder_architecture=False, multi_query=True, parallel_attn=False)),
    "falcon_per_head_alibi": ("falcon", dict(new_decoder_architecture=False, multi_query=False, alibi=True,
                                             hidden_size=48, num_attention_heads=12, num_kv_heads=12)),
    "falcon_one_group_alibi": ("falcon", dict(num_kv_heads=1, num_ln_in_parallel_attn=1, alibi=True)),
}
RECORDS = {model_type: (model_type, {}) for model_type in PREFIX}  # the zoo's tiny models
VOCAB = 101


def _classes(model_type: str, head: str = "ForCausalLM"):
    name = PREFIX[model_type] + head
    return getattr(om, name), getattr(transformers, name)


def _save(root, name: str, model_type: str, overrides: dict, head: str = "ForCausalLM") -> str:
    """``transformers``' model from seed 0 with random norm weights and biases (its init is ones and zeros, under
    which a norm in the wrong place hardly shows), saved under ``root/name``."""
    torch.manual_seed(0)
    model = _classes(model_type, head)[1](zoo.tiny_config(model_type, **overrides))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm) and module.weight is not None:
                module.weight.normal_(1.0, 0.5), module.bias.normal_(0.0, 0.5)
    model.save_pretrained(root / name)
    return str(root / name)


def _pair(model_type: str, path: str, head: str = "ForCausalLM", **parallel):
    ours, theirs = _classes(model_type, head)
    model = ours.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False).train()
    return model, theirs.from_pretrained(path).train()


def _left_padded(batch: int = 2, seq: int = 8):
    """Row 0 whole, row 1 with 3 tokens of left padding (id 0, label -100)."""
    ids = torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :3] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _check_forward_and_grads(model, reference) -> None:
    ids, mask, labels = _left_padded()
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def _check_decode_and_generate(model, reference) -> None:
    """A prefill of 5 tokens and 3 one-token steps on the cache; greedy ``generate`` of a left-padded prompt (the
    mask covers the cached tokens at every step)."""
    model.eval(), reference.eval()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    caches = [transformers.DynamicCache(config=reference.config) for _ in range(2)]
    with torch.no_grad():
        for start, stop in [(0, 5), (5, 6), (6, 7), (7, 8)]:
            expected = reference(ids[:, start:stop], **cache_kwargs(caches[0])).logits
            got = model(ids[:, start:stop], past_key_values=caches[1]).logits
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    prompt = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])
    mask = (prompt != 0).long()
    greedy = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    ours, theirs = model.generate(prompt, **greedy), reference.generate(prompt, **greedy)
    assert ours.shape == (2, 14) and torch.equal(ours, theirs), (ours, theirs)


def _assert_differs(got, expected) -> None:
    """A negative control: ``got`` misses the parity tolerance by at least ten times."""
    assert (got - expected).abs().max() > 10 * (1e-5 + 1e-4 * expected.abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("alibi_families")
    return {name: (model_type, _save(root, name, model_type, overrides))
            for name, (model_type, overrides) in {**VARIANTS, **RECORDS}.items()}


# ------------------------------------------------------------------ tp = 1, in this process
@pytest.mark.parametrize("name", list(VARIANTS) + list(RECORDS))
def test_tp1_switches_match_transformers(name, checkpoints):
    model_type, path = checkpoints[name]
    model, reference = _pair(model_type, path)
    assert set(model.state_dict()) == set(reference.state_dict())
    _check_forward_and_grads(model, reference)
    _check_decode_and_generate(model, reference)


@pytest.mark.parametrize("model_type", list(PREFIX))
def test_every_head_matches_transformers(model_type, tmp_path):
    """The base model and every head ``transformers`` has for the type: same keys, same outputs and losses."""
    ids, mask, labels = _left_padded(batch=3)
    heads = ["Model", "ForSequenceClassification", "ForQuestionAnswering", "ForTokenClassification"]
    if model_type == "opt":  # as transformers: no token classification head for OPT
        assert not hasattr(transformers, "OPTForTokenClassification") and not hasattr(om, "OPTForTokenClassification")
        heads.remove("ForTokenClassification")
    for head in heads:
        path = _save(tmp_path, head, model_type, dict(num_labels=3), head=head)
        model, reference = _pair(model_type, path, head)
        model.eval(), reference.eval()
        assert set(model.state_dict()) == set(reference.state_dict()), head
        inputs = dict(input_ids=ids, attention_mask=mask)
        if head == "ForSequenceClassification":
            inputs["labels"] = torch.tensor([0, 2, 1])
        elif head == "ForTokenClassification":
            inputs["labels"] = labels.clamp(max=2)
        elif head == "ForQuestionAnswering":
            inputs.update(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([4, 5, 7]))
        got, expected = model(**inputs), reference(**inputs)
        for key in ("last_hidden_state", "logits", "start_logits", "end_logits", "loss"):
            if key in expected and expected[key] is not None:
                torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=1e-4, msg=f"{head} {key}")


def test_save_pretrained_loads_in_plain_transformers(checkpoints, tmp_path):
    for name in ("opt", "falcon_one_group_alibi"):
        model_type, path = checkpoints[name]
        model, _ = _pair(model_type, path)
        model.save_pretrained(tmp_path / name)
        reloaded = _classes(model_type)[1].from_pretrained(tmp_path / name).eval()
        ids, mask, _ = _left_padded()
        torch.testing.assert_close(model.eval()(ids, attention_mask=mask).logits,
                                   reloaded(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ negative controls (tp = 1)
def test_residual_before_the_norm_does_not_match(checkpoints):
    """Bloom's ``apply_residual_connection_post_layernorm``: the template's residual taken before the norm (the
    default) does not give ``transformers``' logits."""
    model, reference = _pair("bloom", checkpoints["bloom_residual_post_ln"][1])
    for layer in model.transformer.h:
        layer.residual_after_norm = False
    ids, mask, _ = _left_padded()
    _assert_differs(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


def test_opt_positions_that_ignore_left_padding_do_not_match(checkpoints):
    """OPT counts positions over the unmasked tokens; positions ``0..s-1`` whatever the padding (what the stack
    would use without OPT's hook) change the left-padded row and only it."""
    model, reference = _pair("opt", checkpoints["opt"][1])
    ids, mask, _ = _left_padded()
    expected = reference(ids, attention_mask=mask).logits
    naive = model(ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None].expand_as(ids)).logits
    torch.testing.assert_close(naive[0], expected[0], atol=1e-5, rtol=1e-4)
    _assert_differs(naive[1, 3:], expected[1, 3:])


# ------------------------------------------------------------------ layouts and rules, no process group
def test_alibi_slopes_and_mask():
    """12 heads: 8 slopes of the 8-head series then 4 of the 16-head one; each tp rank its contiguous slice."""
    slopes = alibi_slopes(12)
    assert torch.allclose(slopes[:8], 2.0 ** (-torch.arange(1, 9, dtype=torch.float32)))
    assert torch.allclose(slopes[8:], 2.0 ** (-torch.arange(1, 9, 2, dtype=torch.float32) / 2))
    assert torch.equal(local_alibi_slopes(12, 1, 2), slopes[6:]) and not torch.equal(slopes[6:], slopes[:6])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    bias = alibi_attention_mask(mask, torch.zeros(1, 5), None, slopes[:2])  # [1, 2, 5, 5]
    low = torch.finfo(torch.float32).min
    assert bias.shape == (1, 2, 5, 5) and (bias[0, :, :2] == low).all()  # padded queries see nothing
    slope = slopes[1].item()  # the last query sees keys 2, 3, 4 at positions 0, 1, 2 (counted over the tokens)
    assert torch.equal(bias[0, 1, 4], torch.tensor([low, low, 0.0, slope, 2 * slope]))
    assert (bias[0, 1, 2, 3:] == low).all()  # causal


@pytest.mark.parametrize("groups,q_per_group", [(1, 8), (2, 4), (8, 1)])  # multi-query, new arch, per head
def test_grouped_qkv_split_reads_and_joins(groups, q_per_group):
    head_dim = 3
    full = torch.arange(groups * (q_per_group + 2) * head_dim * 2, dtype=torch.float32).view(-1, 2)
    split = GroupedQKVSplit(0, groups, (q_per_group, 1, 1))
    view = full.view(groups, q_per_group + 2, head_dim, 2)
    queries = view[:, :q_per_group].reshape(-1, head_dim, 2)  # [n, d, 2] in head order
    for size in (1, 2, 4, 8):
        pieces = [split.read_shard(tuple(full.shape), full.__getitem__, rank, size) for rank in range(size)]
        assert all(tuple(piece.shape) == split.local_shape(tuple(full.shape), size) for piece in pieces)
        assert split.full_shape(tuple(pieces[0].shape), size) == tuple(full.shape)
        assert torch.equal(split.join(pieces), full)
        n_local = groups * q_per_group // size
        local_groups, local_q = max(groups // size, 1), q_per_group // max(size // groups, 1)
        for rank, piece in enumerate(pieces):  # query heads r*n/tp .. and the key/value heads they use
            local = piece.view(local_groups, local_q + 2, head_dim, 2)
            assert torch.equal(local[:, :local_q].reshape(-1, head_dim, 2), queries[rank * n_local:][:n_local])
            first = rank * n_local // q_per_group
            assert torch.equal(local[:, local_q:], view[first:first + local_groups, q_per_group:])
        parts = split.replica_parts(pieces[0], size)
        assert sum(part.numel() for part, _ in parts) == pieces[0].numel()
        assert [count for _, count in parts] == ([1] if size <= groups else [1, size // groups])


def test_head_rules_and_refusals_before_any_process_group():
    falcon = zoo.tiny_config("falcon", new_decoder_architecture=False, multi_query=True)
    for tp in (2, 4, 8):  # one key/value head: replicated, never refused
        om.FalconForCausalLM.validate_parallel_config(falcon, om.ParallelConfig(tensor_parallel_size=tp))
    grouped = zoo.tiny_config("falcon", hidden_size=48, num_attention_heads=12, num_kv_heads=4)
    with pytest.raises(ValueError, match="tensor_parallel_size=6 exceeds key/value head groups=4"):
        om.FalconForCausalLM.from_config(grouped, parallel=om.ParallelConfig(tensor_parallel_size=6))
    with pytest.raises(ValueError, match="num_attention_heads=12 is not divisible by tensor_parallel_size=8"):
        om.BloomForCausalLM.from_config(zoo.tiny_config("bloom"), parallel=om.ParallelConfig(tensor_parallel_size=8))
    with pytest.raises(ValueError, match="needs parallel_attn=True"):
        om.FalconForCausalLM.from_config(zoo.tiny_config("falcon", parallel_attn=False))


# ------------------------------------------------------------------ tp = 2 (+ sequence parallelism), one group
def _tp2_worker(checkpoints: dict, folder: str) -> None:
    for name in VARIANTS:
        model_type, path = checkpoints[name]
        model, reference = _pair(model_type, path, tensor_parallel_size=2, sequence_parallel=True)
        _check_forward_and_grads(model, reference)
        # the gradient norm counts the replicated key/value rows of a fused query_key_value once
        expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
        torch.testing.assert_close(grad_norm(model), expected, atol=1e-5, rtol=1e-5)
        _check_decode_and_generate(model, reference)
    for name in ("bloom", "opt"):  # the records' generate at tp 2 (the zoo checks their decode loop)
        model, reference = _pair(name, checkpoints[name][1], tensor_parallel_size=2)
        _check_decode_and_generate(model, reference)

    # pp 2 of a config without OPT's projections and final norm (parts its stages leave out), left-padded rows
    model_type, path = checkpoints["opt_post_norm"]
    model, reference = _pair(model_type, path, pipeline_parallel_size=2, num_microbatches=2)
    ids, mask, labels = _left_padded()
    assert_pipeline_matches(model, reference, dict(input_ids=ids, attention_mask=mask, labels=labels), steps=1)

    # save at tp 2 (replicated key/value rows joined once) -> plain transformers
    model_type, path = checkpoints["falcon_mqa_parallel"]
    model, _ = _pair(model_type, path, tensor_parallel_size=2)
    model.save_pretrained(folder)
    logits = model.eval()(ids, attention_mask=mask).logits
    if torch.distributed.get_rank() == 0:
        reloaded = transformers.FalconForCausalLM.from_pretrained(folder).eval()
        torch.testing.assert_close(logits, reloaded(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)

    # negative controls on Bloom: the slopes of rank 0 on every rank; GPT-2's packed [Q | K | V] split of the
    # per-head [q, k, v] query_key_value (same local shape, wrong rows)
    model, reference = _pair("bloom", checkpoints["bloom"][1], tensor_parallel_size=2)
    expected = reference(ids, attention_mask=mask).logits
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-4)
    heads, base = model.config.num_attention_heads, model.transformer
    base.layer_masks = lambda shape_like, attention_mask, past, *_: {"full_attention": alibi_attention_mask(
        attention_mask, shape_like, past, alibi_slopes(heads)[:heads // 2])}
    _assert_differs(model(ids, attention_mask=mask).logits, expected)
    del base.layer_masks
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-4)
    fused = reference.transformer.h[0].self_attention.query_key_value
    layer = base.h[0].self_attention.query_key_value
    with torch.no_grad():
        for name in ("weight", "bias"):
            full = getattr(fused, name).detach()
            getattr(layer, name).copy_(PackedSplit(0, (1, 1, 1)).read_shard(
                tuple(full.shape), full.__getitem__, model.parallel_context.tp_rank, 2))
    _assert_differs(model(ids, attention_mask=mask).logits, expected)


def test_tp2_switches_generate_and_save_match_transformers(checkpoints, tmp_path):
    run_distributed(_tp2_worker, 2, checkpoints, str(tmp_path / "saved"), timeout=900)


# ------------------------------------------------------------------ context parallelism (rotary Falcon, OPT)
def _cp2_worker(checkpoints: dict) -> None:
    """Right-padded rows (OPT counts its positions over the whole sequence's padding, gathered by the
    context-parallel mask); gradients reduced over the context-parallel ranks by ``shard_data_parallel``."""
    from oslo_models import training
    from oslo_models.data import ContextParallelSplitter
    from oslo_models.parallel_layers.context_parallel import split_sequence

    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, 11:] = 0
    batch = dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    for name in ("falcon", "opt"):
        for mode in ("ring", "all_to_all"):
            model_type, path = checkpoints[name]
            model, reference = _pair(model_type, path, context_parallel_size=2, context_parallel_mode=mode)
            context = model.parallel_context
            local = ContextParallelSplitter(context, shift_labels=True)(batch)
            wrapped, _ = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters()))
            expected, got = reference(**batch), wrapped(**local)
            torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.logits, split_sequence(expected.logits, context.cp_rank, context.cp_size,
                                                                  mode), atol=1e-5, rtol=1e-4)
            expected.loss.backward(), got.loss.backward()
            assert assert_grads_match(model, reference) == len(list(model.parameters()))


def test_cp2_rotary_falcon_and_opt_match_transformers(checkpoints):
    run_distributed(_cp2_worker, 2, checkpoints, timeout=600)
