"""The tensor-parallel dropout RNG rules, checked on the masks themselves, for every family at tp=2, SP off and on.

- Dropout on activations that differ per tp rank draws a different mask on every rank (its own stream): attention
  probabilities of this rank's heads, T5's FFN inner activations (this rank's columns), and under sequence
  parallelism the residual-stream dropouts, which act on this rank's chunk of the sequence.
- Dropout on replicated activations draws the same mask on every tp rank: residual-stream dropouts without SP,
  BERT's embedding dropout (before the SP scatter), classifier heads.

The rules below are written by hand from the model structure, not read from the parallel plans, so a wrong plan
entry fails them. Masks are observed with ``tests.helpers.dropout.DropoutMasks`` (a dispatch mode: no patching).
After the forward the default torch generator must still agree on every tp rank (the per-rank stream is forked
off it and given back), or the next replicated dropout would differ.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.dropout import DropoutMasks, check_tp_rules
from tests.helpers.encoders import mlm_batch, save_tiny, seq2seq_batch, tiny_bert_config, tiny_t5_config
from tests.helpers.models import padded_batch, save_tiny_gpt2

P = 0.2


def _rules(family: str, sp: bool) -> dict[str, str]:
    residual = "split" if sp else "replicated"
    if family == "gpt2":
        return {r"transformer\.drop": residual,
                r"transformer\.h\.\d+\.attn": "split",  # SDPA's attention-probability dropout
                r"transformer\.h\.\d+\.attn\.resid_dropout": residual,
                r"transformer\.h\.\d+\.mlp\.dropout": residual}
    if family in ("bert", "roberta"):
        layer = rf"{family}\.encoder\.layer\.\d+"
        return {rf"{family}\.embeddings\.dropout": "replicated",  # before the SP scatter
                rf"{layer}\.attention\.self": "split",
                rf"{layer}\.attention\.output\.dropout": residual,
                rf"{layer}\.output\.dropout": residual,
                r"dropout" if family == "bert" else r"classifier\.dropout": "replicated"}
    layer = r"(encoder|decoder)\.block\.\d+\.layer\.\d+"
    return {r"(encoder|decoder)\.dropout": residual,
            rf"{layer}\.(SelfAttention|EncDecAttention)": "split",
            rf"{layer}\.dropout": residual,
            rf"{layer}\.DenseReluDense\.dropout": "split"}


def _build(family: str, path: str, sp: bool):
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=sp)
    auto = {"gpt2": om.AutoModelForCausalLM, "t5": om.AutoModelForSeq2SeqLM}.get(
        family, om.AutoModelForSequenceClassification)
    model = auto.from_pretrained(path, parallel=cfg, progress=False).train()
    if family == "gpt2":
        ids, mask, labels = padded_batch(101)
        batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    elif family == "t5":
        inputs, labels = seq2seq_batch()
        batch = dict(inputs, labels=labels)
    else:
        inputs, _ = mlm_batch(pad_token_id=model.config.pad_token_id)
        batch = dict(inputs, labels=torch.tensor([0, 1, 1]))
    return model, batch


def _worker(family: str, path: str) -> None:
    shapes = {}
    for sp in (False, True):
        torch.manual_seed(0)  # every rank alike, as any data-parallel job seeds
        model, batch = _build(family, path, sp)
        with DropoutMasks(model) as recorder:
            model(**batch)
        what = f"{family} tp=2 sp={sp}"
        rules = _rules(family, sp)
        check_tp_rules(recorder.masks, rules, what=what)
        shapes[sp] = [(label, mask.shape) for label, mask in recorder.masks]
        states = [None, None]
        dist.all_gather_object(states, torch.get_rng_state())
        assert torch.equal(states[0], states[1]), f"{what}: the default generator diverged across tp ranks"
    # Under SP the residual-stream draws really were on this rank's half of the sequence.
    residual = [p for p, kind in _rules(family, False).items() if kind != _rules(family, True)[p]]
    assert [label for label, _ in shapes[True]] == [label for label, _ in shapes[False]]
    halved = 0
    for (label, with_sp), (_, without) in zip(shapes[True], shapes[False]):
        if any(re.fullmatch(p, label) for p in residual):
            assert with_sp[1] * 2 == without[1] and with_sp[0] == without[0], (label, with_sp, without)
            halved += 1
    assert halved >= 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dropout")
    bert = dict(hidden_dropout_prob=P, attention_probs_dropout_prob=P)
    return {
        "gpt2": save_tiny_gpt2(root / "gpt2", resid_pdrop=P, embd_pdrop=P, attn_pdrop=P),
        "bert": save_tiny(root / "bert", transformers.BertForSequenceClassification, tiny_bert_config(**bert)),
        "roberta": save_tiny(root / "roberta", transformers.RobertaForSequenceClassification,
                             tiny_bert_config(transformers.RobertaConfig, **bert)),
        "t5": save_tiny(root / "t5", transformers.T5ForConditionalGeneration, tiny_t5_config(dropout_rate=P)),
    }


@pytest.mark.parametrize("family", ["gpt2", "bert", "roberta", "t5"])
def test_tensor_parallel_dropout_masks_follow_the_rng_rules(checkpoints, family):
    run_distributed(_worker, 2, family, checkpoints[family])
