"""ZeRO 1/2/3 (and 3 + CPU offload) over dp=2 for every family with tied weights equal single-process
``transformers``: GPT-2 LM (wte = lm_head), BERT and RoBERTa MLM (word embeddings = MLM decoder, a block of
``_no_split_modules`` holding a tied weight: it must stay in the root FSDP unit), T5 (shared = both embed_tokens
= lm_head). Loss of every step, and every parameter after 3 AdamW steps (gathered from the FSDP shards).

One spawned pair of processes runs all families and stages (2 shared CPU cores).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import VOCAB, save_tiny, tiny_bert_config, tiny_t5_config
from tests.helpers.models import save_tiny_gpt2

STEPS = 3
LAYOUTS = [(1, False), (2, False), (3, False), (3, True)]
FAMILIES = {  # name -> (transformers class, oslo auto class)
    "gpt2": (transformers.GPT2LMHeadModel, om.AutoModelForCausalLM),
    "bert": (transformers.BertForMaskedLM, om.AutoModelForMaskedLM),
    "roberta": (transformers.RobertaForMaskedLM, om.AutoModelForMaskedLM),
    "t5": (transformers.T5ForConditionalGeneration, om.AutoModelForSeq2SeqLM),
}


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def batches(family: str):
    """Dense global batches of 4 (every token is a loss token, so the mean of the two replicas' mean losses is
    the global mean loss)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(3, VOCAB, (4, 8), generator=gen)
        batch = {"input_ids": ids, "labels": ids.roll(1, dims=1)}
        if family == "t5":
            batch["labels"] = torch.randint(3, VOCAB, (4, 4), generator=gen)
        out.append(batch)
    return out


def full_parameters(model) -> dict[str, torch.Tensor]:
    inner = training.unwrap_model(model)
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for name, p in inner.named_parameters()}


def _worker(paths: dict[str, str]) -> None:
    for family, path in paths.items():
        hf_cls, auto = FAMILIES[family]
        reference = hf_cls.from_pretrained(path).train()
        ref_opt = make_optimizer(reference.parameters())
        ref_losses = []
        for batch in batches(family):
            loss = reference(**batch).loss
            loss.backward()
            ref_opt.step(), ref_opt.zero_grad()
            ref_losses.append(loss.detach())
        ref_params = dict(reference.named_parameters())
        for stage, offload in LAYOUTS:
            model = auto.from_pretrained(path, parallel=om.ParallelConfig(data_parallel_size=2),
                                         progress=False).train()
            ctx = model.parallel_context
            model, opt = training.shard_data_parallel(model, make_optimizer(model.parameters()), zero_stage=stage,
                                                      cpu_offload=offload)
            for step, batch in enumerate(batches(family)):
                local = {name: t.chunk(2)[ctx.dp_rank] for name, t in batch.items()}
                loss = model(**local).loss
                loss.backward()
                opt.step(), opt.zero_grad()
                loss = loss.detach().clone()
                torch.distributed.all_reduce(loss, group=ctx.dp_group)
                torch.testing.assert_close(loss / 2, ref_losses[step], atol=1e-5, rtol=1e-5,
                                           msg=lambda m: f"{family} zero{stage} offload={offload} step {step}: {m}")
            for name, value in full_parameters(model).items():
                torch.testing.assert_close(value, ref_params[name].detach(), atol=1e-5, rtol=1e-4,
                                           msg=lambda m, n=name: f"{family} zero{stage} offload={offload} {n}: {m}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "gpt2": save_tiny_gpt2(root / "gpt2"),
        "bert": save_tiny(root / "bert", transformers.BertForMaskedLM, tiny_bert_config()),
        "roberta": save_tiny(root / "roberta", transformers.RobertaForMaskedLM,
                             tiny_bert_config(transformers.RobertaConfig)),
        "t5": save_tiny(root / "t5", transformers.T5ForConditionalGeneration, tiny_t5_config()),
    }


def test_zero_stages_match_transformers_for_tied_families(checkpoints):
    run_distributed(_worker, 2, checkpoints, timeout=300)


def test_tied_embeddings_stay_in_the_root_unit(checkpoints):
    """The unit choice itself: BERT's embeddings (tied to the decoder) are not a unit; its layers are."""
    model = om.AutoModelForMaskedLM.from_pretrained(checkpoints["bert"], progress=False)
    units = training.zero.fsdp_units(model)
    assert model.bert.embeddings not in units
    assert all(layer in units for layer in model.bert.encoder.layer)
    roberta = om.AutoModelForMaskedLM.from_pretrained(checkpoints["roberta"], progress=False)
    assert roberta.roberta.embeddings not in training.zero.fsdp_units(roberta)
