"""Mixtral and Qwen2-MoE with expert parallelism equal plain ``transformers``: logits, router logits, loss with the
load-balancing loss added, every gradient (router, experts, shared expert) and the parameters after 3 AdamW steps
(fp32, atol 1e-5) at ep 1, ep 4, ep 2 x tp 2 + SP, expert tp 2 (ep 2 x etp 2, with and without SP), pp 2 x ep 2,
Qwen2-MoE on the 2D grid (tp 4, experts replicated; saved with the Hub keys)
and ep 2 x dp 4 with ZeRO-1 through ``om.training.prepare``
(experts reduced over the 2 expert-data-parallel ranks), and Mixtral at ep 2 x dp 4 with ZeRO-3 (FSDP2: experts
sharded over edp, everything else over dp). Each data-parallel rank trains on its own batch; the
reference is transformers on every batch, losses averaged (what plain data parallelism computes). Each rank holds
only its E/ep experts; an ep save opens in plain ``transformers`` with the original keys and the same logits. One spawned group of 4 runs every layout.
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
from oslo_models.models.common.feed_forward.moe import check_expert_layout
from oslo_models.training import clip_grad_norm_, load_checkpoint, save_checkpoint
from tests.helpers.dist import run_distributed
from tests.helpers.global_loss import replica_loss, replica_weights
from tests.helpers.models import adamw_pair, assert_grads_match, assert_params_match, padded_batch, save_seeded
from tests.helpers.pipeline import assert_pipeline_matches

VOCAB, EXPERTS = 61, 4
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-6)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
              router_aux_loss_coef=0.3, pad_token_id=0)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=24, num_hidden_layers=2,
                                                  num_local_experts=EXPERTS),
    # layer 1 dense (mlp_only_layers), no top-k renormalization, shared expert with its sigmoid gate
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24, num_hidden_layers=3,
                                                     num_experts=EXPERTS, mlp_only_layers=[1], norm_topk_prob=False),
}
HF = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_seeded(tmp_path_factory.mktemp("moe"), CONFIGS, HF)


def _train_matches(model, reference, *, dp_rank: int, dp_size: int, zero_stage: int = 0, steps: int = 3,
                   accelerator=None):
    """``steps`` AdamW steps, rank ``dp_rank`` on batch ``dp_rank`` of ``dp_size``; the reference runs them all."""
    batches = [padded_batch(VOCAB, batch=2, seq=8, seed=1 + d) for d in range(dp_size)]
    ids, mask, labels = batches[dp_rank]
    # with an accelerator: om.training.prepare (ZeRO-1: dense state over dp, experts' over edp)
    wrapped, opt, ref_opt = adamw_pair(model, reference, zero_stage=zero_stage, accelerator=accelerator, **ADAMW)
    for _ in range(steps):
        expected = [reference(*batch[:1], attention_mask=batch[1], labels=batch[2]) for batch in batches]
        got = wrapped(ids, attention_mask=mask, labels=labels)
        mine = expected[dp_rank]
        torch.testing.assert_close(got.logits, mine.logits, atol=1e-5, rtol=1e-5)
        for got_layer, ref_layer in zip(got.router_logits, mine.router_logits, strict=True):
            torch.testing.assert_close(got_layer, ref_layer, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.aux_loss, mine.aux_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.loss, mine.loss, atol=1e-5, rtol=1e-5)  # includes coef * aux_loss
        (sum(out.loss for out in expected) / dp_size).backward()
        got.loss.backward() if accelerator is None else accelerator.backward(got.loss)
        assert assert_grads_match(model, reference) == len(list(model.parameters()))
        expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        torch.testing.assert_close(clip_grad_norm_(model, 0.5), expected_norm, atol=1e-5, rtol=1e-5)
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, reference)


def _load(path: str, **parallel):
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False)


def test_ep1_matches_transformers(checkpoints, tmp_path):
    for model_type, path in checkpoints.items():
        model = _load(path).train()
        assert type(model).__name__ == HF[model_type].__name__
        reference = HF[model_type].from_pretrained(path).train()
        _train_matches(model, reference, dp_rank=0, dp_size=1)
        ids, mask, _ = padded_batch(VOCAB, batch=1, seq=5)
        model.eval(), reference.eval()
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           reference.generate(ids, max_new_tokens=4, do_sample=False))
        # a resumable training checkpoint at ep 1 restores every expert
        save_checkpoint(tmp_path / model_type, model)
        restored = _load(path)
        load_checkpoint(tmp_path / model_type, restored)
        saved = dict(model.named_parameters())
        for name, param in restored.named_parameters():
            assert torch.equal(param, saved[name]), name


def _resident_experts_are_own(model) -> None:
    ctx = model.parallel_context
    for layer in model.model.layers:
        if not layer.is_sparse:
            continue
        experts = layer.mlp.experts
        assert experts.gate_up_proj.shape[0] == experts.down_proj.shape[0] == EXPERTS // ctx.ep_size
        # expert tensor parallelism: 1/etp of each expert's feed-forward
        per_rank = experts.intermediate_dim // ctx.etp_size
        assert experts.gate_up_proj.shape[1] == 2 * experts.down_proj.shape[2] == 2 * per_rank
        assert experts.first_expert == ctx.ep_rank * EXPERTS // ctx.ep_size


def _layouts_worker(checkpoints: dict, out_root: str) -> None:
    # from_config at ep4 slices exactly the weights transformers draws from the seed; ZeRO-2/3 with ep say so
    config = CONFIGS["qwen2_moe"]()
    torch.manual_seed(3)
    reference = HF["qwen2_moe"](config)
    torch.manual_seed(3)
    model = om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(expert_parallel_size=4))
    _resident_experts_are_own(model)
    assert_params_match(model, reference, atol=0, rtol=0)
    # (ep, tp, expert tp, sequence parallel, ZeRO stage): ep2 x tp2 + SP (experts whole, the block gathers the
    # sequence), expert tp 2 (ep2 x etp2), and ep2 x etp2 + SP (reduce-scatter after the combine)
    for ep, tp, etp, sp, zero_stage in ((4, 1, 1, False, 0), (2, 2, 1, True, 0), (2, 2, 2, False, 0),
                                        (2, 2, 2, True, 0), (2, 1, 1, False, 1), (2, 1, 1, False, 3)):
        for model_type, path in checkpoints.items():
            if zero_stage == 3 and model_type != "mixtral":
                continue  # ZeRO-3 (experts sharded over edp, the rest over dp): one family is enough
            model = _load(path, expert_parallel_size=ep, tensor_parallel_size=tp, expert_tensor_parallel_size=etp,
                          sequence_parallel=sp).train()
            ctx = model.parallel_context
            assert (ctx.ep_size, ctx.tp_size, ctx.edp_size, ctx.etp_size) == (ep, tp, ctx.dp_size // ep, etp)
            _resident_experts_are_own(model)
            reference = HF[model_type].from_pretrained(path).train()
            accelerator = Accelerator(cpu=True) if zero_stage else None
            _train_matches(model, reference, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, zero_stage=zero_stage,
                           accelerator=accelerator)
            if zero_stage:
                continue
            # the trained model saves a plain checkpoint: transformers' keys and shapes, same logits
            if sp:
                continue  # the save below is the same at tp2 without SP
            out = os.path.join(out_root, f"{model_type}-ep{ep}-tp{tp}-etp{etp}")
            model.eval()
            ids, mask, _ = padded_batch(VOCAB)
            logits = model(ids, attention_mask=mask).logits
            model.save_pretrained(out)
            if dist.get_rank() == 0:
                plain = HF[model_type].from_pretrained(out)
                saved = load_file(os.path.join(out, "model.safetensors"))
                original = load_file(os.path.join(path, "model.safetensors"))
                assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
                torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, atol=1e-5, rtol=1e-5)
    # the 2D grid (tp4, experts replicated): Qwen2-MoE (its shared expert and gate, a dense layer; Mixtral trains
    # there in tests/composition/combined.py); the trained model saves the Hub keys and shapes, experts whole
    path = checkpoints["qwen2_moe"]
    model = _load(path, tensor_parallel_size=4, tensor_parallel_mode="2d").train()
    _train_matches(model, HF["qwen2_moe"].from_pretrained(path).train(), dp_rank=0, dp_size=1)
    model.save_pretrained(os.path.join(out_root, "qwen2_moe-2d"))
    if dist.get_rank() == 0:
        saved = load_file(os.path.join(out_root, "qwen2_moe-2d", "model.safetensors"))
        original = load_file(os.path.join(path, "model.safetensors"))
        assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
    # pp2 x ep2 (x dp2): GPipe, one microbatch; experts' gradients summed over edp in the pipeline's sync; the
    # reference loss is the global batch's token loss plus the mean of the replicas' load-balancing losses (per
    # replica: tests/helpers/global_loss.py)
    for model_type, path in checkpoints.items():
        model = _load(path, pipeline_parallel_size=2, expert_parallel_size=2, pipeline_schedule="gpipe",
                      num_microbatches=1, pipeline_partition="parameters")
        assert model.parallel_context.ep_size == 2
        ids, mask, labels = padded_batch(VOCAB, batch=4, seq=8, seed=7)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)

        def replicas_mean(ref, b):
            halves = [{k: v[i:i + 2] for k, v in b.items()} for i in (0, 2)]
            weights = replica_weights(halves, shift=True)
            return sum(replica_loss(ref(**half), half, w, shift=True) for half, w in zip(halves, weights)) / 2

        assert_pipeline_matches(model, HF[model_type].from_pretrained(path).train(), batch, steps=2,
                                reference_loss=replicas_mean)


def test_expert_parallel_layouts_match_transformers_and_save(checkpoints, tmp_path):
    run_distributed(_layouts_worker, 4, checkpoints, str(tmp_path), timeout=600)


def test_clear_errors(checkpoints):
    config = om.MixtralConfig.from_pretrained(checkpoints["mixtral"])
    with pytest.raises(ValueError, match="4 experts of each layer cannot be split over expert_parallel_size=3"):
        om.MixtralForCausalLM.validate_parallel_config(config, om.ParallelConfig(expert_parallel_size=3))
    with pytest.raises(ValueError, match="expert_parallel_size=2 must divide data_parallel_size=1"):
        _load(checkpoints["mixtral"], expert_parallel_size=2)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=3 must divide tensor_parallel_size=2"):
        om.ParallelConfig(tensor_parallel_size=2, expert_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="expert feed-forward size 24 is not divisible"):
        check_expert_layout("mixtral", EXPERTS,
                            om.ParallelConfig(tensor_parallel_size=5, expert_tensor_parallel_size=5),
                            expert_intermediate_size=24, sequence_parallel=True)
    # the 2D grid runs the SparseMoeBlock families with replicated experts (tests/composition/combined.py trains
    # Mixtral there); a family without it, the 3D cube, experts split over ep and pipeline stages are refused
    grid = om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d")
    om.MixtralForCausalLM.validate_parallel_config(config, grid)
    with pytest.raises(NotImplementedError, match="tensor_parallel_mode='2d' with this family's mixture-of-experts"):
        check_expert_layout("mixtral", EXPERTS, grid, expert_intermediate_size=24, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="tensor_parallel_mode='3d' with mixture-of-experts"):
        check_expert_layout("mixtral", EXPERTS, om.ParallelConfig(tensor_parallel_size=8, tensor_parallel_mode="3d"),
                            expert_intermediate_size=24, sequence_parallel=True, grid=True)
    with pytest.raises(NotImplementedError, match="'2d' with expert_parallel_size > 1 is not implemented"):
        om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d", data_parallel_size=2,
                          expert_parallel_size=2)
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size > 1 with tensor_parallel_mode='2d'"):
        om.MixtralForCausalLM.validate_parallel_config(
            config, om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d", pipeline_parallel_size=2))
