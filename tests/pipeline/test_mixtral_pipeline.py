"""Mixture-of-experts decoders pipelined (pp 2, 2 ranks, right-padded batch): ``model.train_step`` equals
single-process ``transformers``: loss with the load-balancing loss, every gradient (router and experts) and the
parameters after 3 AdamW steps, then ``eval_step`` (fp32, atol 1e-5). The load-balancing statistics cross the
stage boundary (``models/mixtral/pipeline_mixtral.py``). One microbatch: exactly ``transformers``' loss on the
batch. Two microbatches: the batch's causal-LM loss + ``router_aux_loss_coef`` x the mean of the microbatches'
load-balancing losses (Megatron's per-microbatch aux loss). Mixtral (4 sparse layers, 2 per stage; gpipe and
1f1b) and Qwen2-MoE (a dense layer, shared expert; zero-bubble, 2 stages per rank) in one spawned group."""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.models import padded_batch, save_seeded
from tests.helpers.pipeline import assert_pipeline_matches

VOCAB = 61
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2, output_router_logits=True,
              router_aux_loss_coef=0.3, pad_token_id=0, num_hidden_layers=4)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=24, num_local_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=40, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24, num_experts=4,
                                                     mlp_only_layers=[1], norm_topk_prob=False),
}
HF = {"mixtral": transformers.MixtralForCausalLM, "qwen2_moe": transformers.Qwen2MoeForCausalLM}


def _batch():
    ids, mask, labels = padded_batch(VOCAB, batch=4, seq=8, seed=3)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _per_microbatch_loss(num_microbatches: int):
    """The batch's causal-LM loss + coef x mean over microbatches of transformers' load-balancing loss."""
    def loss(reference, batch):
        lm = reference(**batch, output_router_logits=False).loss
        aux = [reference(input_ids=ids, attention_mask=mask).aux_loss
               for ids, mask in zip(batch["input_ids"].chunk(num_microbatches),
                                    batch["attention_mask"].chunk(num_microbatches))]
        return lm + reference.config.router_aux_loss_coef * torch.stack(aux).mean()
    return loss


def _worker(paths: dict) -> None:
    # Qwen2-MoE: zero-bubble over 4 stages of one layer; stage 1 (the dense layer) passes the statistics on
    for model_type, microbatches, schedule, virtual in (("mixtral", 1, "gpipe", 1), ("mixtral", 2, "1f1b", 1),
                                                        ("qwen2_moe", 2, "zero_bubble", 2)):
        cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=microbatches, pipeline_schedule=schedule,
                                virtual_pipeline_size=virtual)
        model = om.AutoModelForCausalLM.from_pretrained(paths[model_type], parallel=cfg, progress=False).train()
        assert len(model.model.layers) == 2
        reference = HF[model_type].from_pretrained(paths[model_type]).train()
        # one microbatch: transformers' own loss on the batch (CE + coef x aux over all layers and rows)
        reference_loss = None if microbatches == 1 else _per_microbatch_loss(microbatches)
        assert_pipeline_matches(model, reference, _batch(), reference_loss=reference_loss)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_seeded(tmp_path_factory.mktemp("moe_pp"), CONFIGS, HF)


def test_moe_pipeline_matches_transformers(checkpoints):
    run_distributed(_worker, 2, checkpoints, timeout=300)


def test_moe_pipeline_accepts_tp_and_ep(checkpoints):
    """pp x ep and pp x tp are accepted (run: tests/models/test_moe_parity.py pp2 x ep2, the zoo's pp2 x tp2)."""
    config = om.MixtralConfig.from_pretrained(checkpoints["mixtral"])
    for parallel in (dict(expert_parallel_size=2, data_parallel_size=2), dict(tensor_parallel_size=2)):
        om.MixtralForCausalLM.validate_parallel_config(config, om.ParallelConfig(pipeline_parallel_size=2, **parallel))
