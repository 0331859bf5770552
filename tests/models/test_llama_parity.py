"""Llama, Mistral, Qwen2 and Qwen3 at every tensor-parallel layout equal plain ``transformers``: logits, loss, every
gradient and the parameters after 3 AdamW steps (fp32, atol 1e-5), with and without sequence parallelism; a tp2
save opens in plain ``transformers`` with the same keys and logits; tp4 replicates the 2 key/value heads over
pairs of ranks (gradients of the copies summed, saved once, counted once by the gradient norm, resumed from a
training checkpoint at tp2 x dp2).

Which switch each tiny model turns on is listed in ``tests/helpers/decoders.py``. One spawned group per world
size runs every type, so the references are built once per process.
"""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import oslo_models as om
from oslo_models import training
from oslo_models.parallel_layers.kv_heads import KVHeadColumnParallelLinear
from oslo_models.training import clip_grad_norm_
from tests.helpers.decoders import VOCAB, hf_class, save_all, tiny_config
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match, assert_params_match, padded_batch

ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_all(tmp_path_factory.mktemp("decoders"))


def _train_matches(model, reference, *, steps: int = 3, clip: float | None = None) -> None:
    """``steps`` AdamW steps on a right-padded batch: logits, loss, every gradient, (the clipped norm) and every
    parameter after each step equal the reference's."""
    ids, mask, labels = padded_batch(VOCAB, batch=3, seq=8)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for _ in range(steps):
        expected = reference(ids, attention_mask=mask, labels=labels)
        got = model(ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, expected.loss, atol=1e-5, rtol=1e-5)
        expected.loss.backward()
        got.loss.backward()
        assert assert_grads_match(model, reference) == len(list(model.parameters()))
        if clip is not None:
            expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            torch.testing.assert_close(clip_grad_norm_(model, clip), expected_norm, atol=1e-5, rtol=1e-5)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, reference)


def _load(path: str, tp: int, sp: bool, **options):
    cfg = om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp, **options)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()


def _reference(path: str, model_type: str):
    return hf_class(model_type).from_pretrained(path).train()


def test_tp1_matches_transformers(checkpoints):
    for model_type, path in checkpoints.items():
        model = _load(path, 1, False)
        assert type(model).__name__ == hf_class(model_type).__name__
        _train_matches(model, _reference(path, model_type))


def _tp2_worker(checkpoints: dict, out_root: str) -> None:
    for model_type, path in checkpoints.items():
        for sp in (True, False) if model_type == "llama" else (True,):
            model = _load(path, 2, sp)
            k_proj = model.model.layers[0].self_attn.k_proj
            assert isinstance(k_proj, KVHeadColumnParallelLinear) and k_proj.replicas == 1
            assert k_proj.weight.shape[0] == k_proj.full_out_features // 2  # one of the two kv heads per rank
            _train_matches(model, _reference(path, model_type))
        # The trained tp2 model saves a plain checkpoint: same keys as transformers', same logits when reloaded.
        out = os.path.join(out_root, model_type)
        model.eval()
        ids, mask, _ = padded_batch(VOCAB)
        logits = model(ids, attention_mask=mask).logits
        model.save_pretrained(out)
        if torch.distributed.get_rank() == 0:
            plain = hf_class(model_type).from_pretrained(out)
            saved = load_file(os.path.join(out, "model.safetensors"))
            assert set(saved) == set(load_file(os.path.join(path, "model.safetensors")))
            torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, atol=1e-5, rtol=1e-5)
            assert plain.config.architectures == [hf_class(model_type).__name__]


def test_tp2_sequence_parallel_matches_transformers_and_saves(checkpoints, tmp_path):
    run_distributed(_tp2_worker, 2, checkpoints, str(tmp_path), timeout=600)


def _tp4_worker(checkpoints: dict, out_root: str) -> None:
    for model_type, path in checkpoints.items():
        model = _load(path, 4, True)
        attn = model.model.layers[0].self_attn
        # 2 kv heads over 4 ranks: each rank holds one, shared with its neighbour; 2 query heads per rank use it.
        assert attn.k_proj.replicas == 2 and attn.num_key_value_groups == 2
        _train_matches(model, _reference(path, model_type), clip=0.5 if model_type == "llama" else None)
        heads = attn.k_proj.weight.detach().clone()
        pair = [torch.empty_like(heads) for _ in range(4)]
        torch.distributed.all_gather(pair, heads, group=model.parallel_context.tp_group)
        rank = model.parallel_context.tp_rank
        assert torch.equal(pair[rank], pair[rank ^ 1])  # the copies stayed identical through training
        out = os.path.join(out_root, model_type)
        model.save_pretrained(out)
        if torch.distributed.get_rank() == 0:  # each kv head saved once, at its original shape
            saved = load_file(os.path.join(out, "model.safetensors"))
            original = load_file(os.path.join(path, "model.safetensors"))
            assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
    model = _load(checkpoints["llama"], 4, False)
    _train_matches(model, _reference(checkpoints["llama"], "llama"), steps=1)
    _resume_across_layouts(checkpoints["qwen2"], os.path.join(out_root, "resume"))
    # from_config at tp4 slices (and replicates) exactly the weights transformers draws from the seed
    config = tiny_config("qwen3")
    torch.manual_seed(3)
    reference = hf_class("qwen3")(config)
    torch.manual_seed(3)
    model = om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=4))
    assert_params_match(model, reference, atol=0, rtol=0)


def _resume_across_layouts(path: str, folder: str) -> None:
    """A training checkpoint saved at tp4 (key/value heads replicated) resumes at tp2 x dp2 (heads split): the
    weights and the AdamW state continue exactly as the uninterrupted single-process run."""
    ids, mask, labels = padded_batch(VOCAB, batch=3, seq=8)
    reference = _reference(path, "qwen2")
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    model = _load(path, 4, True)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    for net, optimizer in ((reference, ref_opt), (model, opt)):
        net(ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step(), optimizer.zero_grad()
    training.save_checkpoint(folder, model, opt, step=1)
    resumed = _load(path, 2, True)  # tp2 x dp2: each rank owns one whole kv head now
    om.distributed.mark_gradients_reduced(resumed, "test: the same batch on every replica")
    opt = torch.optim.AdamW(resumed.parameters(), **ADAMW)
    training.load_checkpoint(folder, resumed, opt)
    assert_params_match(resumed, reference)
    for net, optimizer in ((reference, ref_opt), (resumed, opt)):  # the same batch on every replica
        net(ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step(), optimizer.zero_grad()
    assert_params_match(resumed, reference)


def test_tp4_replicates_kv_heads_and_matches_transformers(checkpoints, tmp_path):
    run_distributed(_tp4_worker, 4, checkpoints, str(tmp_path), timeout=600)
