"""Switch Transformers with expert parallelism equal plain ``transformers``: logits, router logits of both stacks,
the loss with the router z-loss and load-balancing loss added, every gradient (routers, stacked experts) and the
parameters after 3 AdamW steps (fp32, atol 1e-5), at ep 1 (in process), and ep 4, ep 2 x tp 2, ep 2 x edp 2 with
ZeRO-1 through ``om.training.prepare`` in one spawned group of 4; the experts dropless-grouped (the default) and,
at ep 1 and ep 2 x tp 2, padded to the largest count (the capacity drop is the router's: the same either way).

The capacity is per sequence (as ``transformers``' router), so tokens drop identically at any ep: the main
checkpoint drops tokens (asserted from the router logits), at every layout; a second one with a capacity no
sequence can exceed drops none, at ep 4. Each data-parallel rank trains on its own batch; the reference is
``transformers`` on every batch, losses averaged. Each rank holds only its E/ep experts; an ep save opens in plain
``transformers`` with the original per-expert keys (``mlp.experts.expert_{i}.wi.weight``) and the same logits.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors.torch import load_file

import oslo_models as om
from accelerate import Accelerator
from oslo_models.conversion.checkpoint import InMemoryReader
from oslo_models.models.common.loading.expert_keys import ExpertKeyReader
from oslo_models.parallel_layers.moe import set_expert_implementation
from oslo_models.training import clip_grad_norm_
from tests.helpers.dist import run_distributed
from tests.helpers.models import adamw_pair, expected_shard, padded_batch

VOCAB, EXPERTS, SEQ = 61, 4, 8
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)
HF = transformers.SwitchTransformersForConditionalGeneration


def _config(capacity: int) -> transformers.SwitchTransformersConfig:
    # 4 layers, sparse step 2: layers 1 and 3 of each stack are sparse, so transformers adds both router losses
    return transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=24, num_heads=4, num_layers=4, num_decoder_layers=4,
        num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_experts=EXPERTS, expert_capacity=capacity,
        router_jitter_noise=0.0, dropout_rate=0.0, decoder_start_token_id=0, router_z_loss_coef=0.3,
        router_aux_loss_coef=0.2)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("switch")
    paths = {}
    for name, capacity in (("drops", 3), ("dropless", SEQ)):
        torch.manual_seed(0)
        HF(_config(capacity)).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _batch(d: int):
    ids, mask, labels = padded_batch(VOCAB, batch=2, seq=SEQ, seed=1 + d)
    return dict(input_ids=ids, attention_mask=mask, labels=labels[:, :6].contiguous(),
                output_router_logits=True)


def _dropped(out, capacity: int) -> int:
    """Tokens over their expert's capacity in their sequence, from the router logits of every sparse layer."""
    dropped = 0
    for logits in (*out.encoder_router_logits, *out.decoder_router_logits):
        counts = torch.nn.functional.one_hot(logits.argmax(-1), EXPERTS).sum(1)  # [b, E]
        dropped += int((counts - capacity).clamp(min=0).sum())
    return dropped


def _stacked(reference, grads: bool) -> dict[str, torch.Tensor]:
    """The reference's parameters (or gradients) under this project's names: per-expert tensors stacked."""
    tensors = {name: (param.grad if grads else param.detach())
               for name, param in reference.named_parameters(remove_duplicate=False)}
    reader = ExpertKeyReader(InMemoryReader(tensors), om.SwitchTransformersForConditionalGeneration.expert_key_layout)
    return {key: reader.read(key) for key in reader.keys()}


TIED = {"lm_head.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}


def _assert_match(model, reference, grads: bool) -> None:
    """Every parameter (or gradient) equals this rank's slice of the reference's; all of the reference's are
    covered (the tied ones under ``shared.weight``)."""
    full = _stacked(reference, grads)
    names = {name for name, _ in model.named_parameters()}
    assert names <= set(full) and set(full) - names == TIED, set(full) ^ names
    for name, param in model.named_parameters():
        got = param.grad if grads else param.detach()
        assert got is not None, f"{name} has no gradient"
        torch.testing.assert_close(got, expected_shard(model, name, full[name]), atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _zero_missing_grads(reference) -> None:
    """An expert no token reached never ran in ``transformers`` (a module per expert), so it has no gradient and
    AdamW skips it; stacked experts (here, Mesh TensorFlow's Switch, ``transformers``' own Mixtral) give it a zero
    gradient, which AdamW decays and moves by its moments. The reference gets the zero gradient too."""
    for param in reference.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)


def _train_matches(model, reference, *, dp_rank: int, dp_size: int, zero_stage: int = 0, accelerator=None,
                   drops: bool = True):
    batches = [_batch(d) for d in range(dp_size)]
    # with an accelerator: om.training.prepare (ZeRO-1: dense state over dp, experts' over edp)
    wrapped, opt, ref_opt = adamw_pair(model, reference, zero_stage=zero_stage, accelerator=accelerator, **ADAMW)
    for _ in range(3):
        expected = [reference(**batch) for batch in batches]
        got, mine = wrapped(**batches[dp_rank]), expected[dp_rank]
        assert (_dropped(mine, reference.config.expert_capacity) > 0) == drops
        torch.testing.assert_close(got.logits, mine.logits, atol=1e-5, rtol=1e-5)
        for stack in ("encoder", "decoder"):
            for got_layer, ref_layer in zip(getattr(got, f"{stack}_router_logits"),
                                            getattr(mine, f"{stack}_router_logits"), strict=True):
                torch.testing.assert_close(got_layer, ref_layer, atol=1e-5, rtol=1e-5)
            for kind in ("z", "aux"):
                torch.testing.assert_close(getattr(got, f"{stack}_{kind}_loss"),
                                           getattr(mine, f"{stack}_{kind}_loss"), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, mine.loss, atol=1e-5, rtol=1e-5)  # includes both router losses
        (sum(out.loss for out in expected) / dp_size).backward()
        _zero_missing_grads(reference)
        got.loss.backward() if accelerator is None else accelerator.backward(got.loss)
        _assert_match(model, reference, grads=True)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(clip_grad_norm_(model, 0.5), expected_norm, atol=1e-5, rtol=1e-5)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        _assert_match(model, reference, grads=False)


def _load(path: str, cls=om.AutoModelForSeq2SeqLM, **parallel):
    return cls.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False)


def test_ep1_matches_transformers(checkpoints):
    path = checkpoints["drops"]
    torch.manual_seed(5)  # from_config draws the weights transformers draws from the same seed
    fresh = om.AutoModelForSeq2SeqLM.from_config(_config(3))
    torch.manual_seed(5)
    _assert_match(fresh, HF(_config(3)), grads=False)
    for implementation in ("padded", "grouped"):  # the experts padded to the largest count, then dropless grouped
        model = _load(path).train()
        assert set_expert_implementation(model, implementation) == 4
        assert type(model).__name__ == HF.__name__
        reference = HF.from_pretrained(path).train()
        _train_matches(model, reference, dp_rank=0, dp_size=1)
    model.eval(), reference.eval()
    ids = _batch(0)["input_ids"]
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                       reference.generate(ids, max_new_tokens=4, do_sample=False))
    # without output_router_logits: the language-model loss alone, as transformers
    plain = dict(_batch(0), output_router_logits=False)
    torch.testing.assert_close(model(**plain).loss, reference(**plain).loss, atol=1e-5, rtol=1e-5)
    # the base and encoder models (AutoModel / AutoModelForTextEncoding) on the same checkpoint
    batch = dict(input_ids=ids, attention_mask=_batch(0)["attention_mask"], output_router_logits=True)
    for cls, hf_cls, extra in ((om.AutoModel, transformers.SwitchTransformersModel, dict(decoder_input_ids=ids)),
                               (om.AutoModelForTextEncoding, transformers.SwitchTransformersEncoderModel, {})):
        model = _load(path, cls)
        assert type(model).__name__ == hf_cls.__name__
        got, expected = model(**batch, **extra), hf_cls.from_pretrained(path)(**batch, **extra)
        torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
        logits = "encoder_router_logits" if hf_cls is transformers.SwitchTransformersModel else "router_logits"
        for got_layer, ref_layer in zip(getattr(got, logits), getattr(expected, logits), strict=True):
            torch.testing.assert_close(got_layer, ref_layer, atol=1e-5, rtol=1e-5)


def _resident_experts_are_own(model) -> None:
    ctx, sparse = model.parallel_context, 0
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            feed_forward = block.layer[-1]
            if not feed_forward.is_sparse:
                continue
            experts, sparse = feed_forward.mlp.experts, sparse + 1
            assert experts.wi.shape[0] == experts.wo.shape[0] == EXPERTS // ctx.ep_size
            assert experts.first_expert == ctx.ep_rank * EXPERTS // ctx.ep_size
    assert sparse == 4


def _layouts_worker(checkpoints: dict, out_root: str) -> None:
    # the experts run dropless-grouped (the default) everywhere and padded at ep 2 x tp 2
    for name, ep, tp, zero_stage, implementation in (
            ("drops", 4, 1, 0, "grouped"), ("dropless", 4, 1, 0, "grouped"), ("drops", 2, 2, 0, "grouped"),
            ("drops", 2, 1, 1, "grouped"), ("drops", 2, 2, 0, "padded")):
        path = checkpoints[name]
        model = _load(path, expert_parallel_size=ep, tensor_parallel_size=tp).train()
        set_expert_implementation(model, implementation)
        ctx = model.parallel_context
        assert (ctx.ep_size, ctx.tp_size, ctx.edp_size) == (ep, tp, ctx.dp_size // ep)
        _resident_experts_are_own(model)
        reference = HF.from_pretrained(path).train()
        accelerator = Accelerator(cpu=True) if zero_stage else None
        _train_matches(model, reference, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, zero_stage=zero_stage,
                       accelerator=accelerator, drops=name == "drops")
        if zero_stage or name == "dropless" or implementation == "padded":
            continue
        # the trained model saves a plain checkpoint: transformers' per-expert keys and shapes, same logits
        out = os.path.join(out_root, f"ep{ep}-tp{tp}")
        model.eval()
        batch = _batch(0)
        logits = model(**batch).logits
        model.save_pretrained(out)
        if dist.get_rank() == 0:
            plain = HF.from_pretrained(out)
            saved = load_file(os.path.join(out, "model.safetensors"))
            original = load_file(os.path.join(path, "model.safetensors"))
            assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
            torch.testing.assert_close(plain(**batch).logits, logits, atol=1e-5, rtol=1e-5)


def test_expert_parallel_layouts_match_transformers_and_save(checkpoints, tmp_path):
    run_distributed(_layouts_worker, 4, checkpoints, str(tmp_path), timeout=600)


def test_clear_errors(checkpoints):
    config = om.SwitchTransformersConfig.from_pretrained(checkpoints["drops"])
    with pytest.raises(ValueError, match="4 experts of each layer cannot be split over expert_parallel_size=3"):
        om.SwitchTransformersForConditionalGeneration.validate_parallel_config(
            config, om.ParallelConfig(expert_parallel_size=3))
    with pytest.raises(NotImplementedError, match="sequence_parallel"):
        _load(checkpoints["drops"], tensor_parallel_size=2, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size"):
        _load(checkpoints["drops"], pipeline_parallel_size=2)
