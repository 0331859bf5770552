"""BERT / RoBERTa pipelined equal single-process ``transformers``: masked LM on a padded batch with sparse MLM
labels (every pp=2 schedule, pp=4, pp x tp with sequence parallelism, pp x dp) and BERT sequence classification —
loss, every gradient and the parameters after 3 AdamW steps; each stage holds only its own parameters; a save
from pp=2 x tp=2 opens in plain ``transformers`` with the same logits.

Two spawned worlds (2 CPU cores); each worker runs several layouts one after the other.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import VOCAB, save_tiny, tiny_bert_config
from tests.helpers.models import padded_batch
from tests.helpers.pipeline import assert_pipeline_matches

NUM_LAYERS = 4
#: family -> (transformers class, oslo class, prefixes of the head parameters only the last stage holds)
FAMILIES = {
    "bert": (transformers.BertForMaskedLM, om.BertForMaskedLM, ("cls.",)),
    "roberta": (transformers.RobertaForMaskedLM, om.RobertaForMaskedLM, ("lm_head.",)),
    "bert_cls": (transformers.BertForSequenceClassification, om.BertForSequenceClassification,
                 ("bert.pooler.", "classifier.")),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return {
        "bert": save_tiny(root / "bert", transformers.BertForMaskedLM, tiny_bert_config(num_hidden_layers=NUM_LAYERS)),
        "roberta": save_tiny(root / "roberta", transformers.RobertaForMaskedLM,
                             tiny_bert_config(transformers.RobertaConfig, num_hidden_layers=NUM_LAYERS)),
        "bert_cls": save_tiny(root / "bert_cls", transformers.BertForSequenceClassification,
                              tiny_bert_config(num_hidden_layers=NUM_LAYERS, num_labels=3)),
    }


def mlm_batch(pad_token_id: int) -> dict[str, torch.Tensor]:
    """4 right-padded rows (8, 6, 4, 2 tokens) with two token types; as in real MLM, labels on about a third of
    the tokens (at least one per row) and ``-100`` everywhere else, padding included."""
    ids, mask, _ = padded_batch(VOCAB, batch=4, seq=8)
    ids = ids.masked_fill(ids == pad_token_id, 5).masked_fill(mask == 0, pad_token_id)
    picked = torch.rand(4, 8, generator=torch.Generator().manual_seed(7)) < 0.3
    picked[:, 1] = True
    labels = torch.randint(2, VOCAB, (4, 8), generator=torch.Generator().manual_seed(8))
    labels = labels.masked_fill(~picked | (mask == 0), -100)
    token_type_ids = (torch.arange(8) >= 3).long().expand(4, 8) * mask
    return dict(input_ids=ids, attention_mask=mask, token_type_ids=token_type_ids, labels=labels)


def _assert_resident(model, reference, head_prefixes) -> None:
    """The stage's parameters are exactly its layers', plus the embeddings' on the first stage and the head's on
    the last (the decoder's bias is the head's ``bias``, one Parameter)."""
    layout, base = model.pipeline_layout, model.base_model_prefix
    prefixes = tuple(f"{base}.encoder.layer.{i}." for i in layout.local_layers())
    prefixes += (f"{base}.embeddings.",) if layout.has_first else ()
    prefixes += tuple(head_prefixes) if layout.has_last else ()
    expected = {name for name, _ in reference.named_parameters(remove_duplicate=False)
                if name.startswith(prefixes) and not name.endswith("decoder.bias")}
    assert {name for name, _ in model.named_parameters()} == expected


def _run_layout(family: str, path: str, cfg: om.ParallelConfig, batch, *, reference_loss=None, save_to=None):
    hf_class, om_class, head_prefixes = FAMILIES[family]
    reference = hf_class.from_pretrained(path).train()
    model = om_class.from_pretrained(path, parallel=cfg, progress=False).train()
    assert model.parallel_context.pp_size == cfg.pipeline_parallel_size
    _assert_resident(model, reference, head_prefixes)
    assert_pipeline_matches(model, reference, batch, reference_loss=reference_loss)
    if save_to is not None:
        model.save_pretrained(save_to)
        if model.parallel_context.rank == 0:
            inputs = {name: tensor for name, tensor in batch.items() if name != "labels"}
            loaded, reference = hf_class.from_pretrained(save_to).eval(), reference.eval()
            torch.testing.assert_close(loaded(**inputs).logits, reference(**inputs).logits, atol=1e-5, rtol=1e-5)
        model.parallel_context.barrier()


def _world2_worker(paths: dict) -> None:
    batch = mlm_batch(0)
    for schedule, virtual, microbatches in [("gpipe", 1, 2), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4),
                                            ("zero_bubble", 2, 4)]:
        cfg = om.ParallelConfig(pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=microbatches,
                                virtual_pipeline_size=virtual)
        _run_layout("bert", paths["bert"], cfg, batch)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2)
    _run_layout("roberta", paths["roberta"], cfg, mlm_batch(1))
    # Sequence classification: one ignored label, so the microbatches' means weigh 1 and 2 of 3 items.
    classify = {name: batch[name] for name in ("input_ids", "attention_mask", "token_type_ids")}
    _run_layout("bert_cls", paths["bert_cls"], cfg, dict(classify, labels=torch.tensor([0, -100, 1, 2])))


def _world4_worker(paths: dict, save_to: str) -> None:
    batch = mlm_batch(0)
    cfg = om.ParallelConfig(pipeline_parallel_size=4, pipeline_schedule="1f1b", num_microbatches=4)
    _run_layout("bert", paths["bert"], cfg, batch)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True,
                            num_microbatches=2)
    _run_layout("bert", paths["bert"], cfg, batch, save_to=save_to)
    _run_layout("roberta", paths["roberta"], cfg, mlm_batch(1))
    # pp x dp on the padded batch: the replicas hold different label counts, and the step's loss is still the
    # whole global batch's (its summed token losses over all its label tokens: training/global_batch.py)
    cfg = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2)
    _run_layout("bert", paths["bert"], cfg, batch)


def test_pp2_every_schedule_roberta_and_classification_match_transformers(checkpoints):
    run_distributed(_world2_worker, 2, checkpoints)


def test_pp4_pp_tp_sp_and_pp_dp_match_transformers(checkpoints, tmp_path):
    run_distributed(_world4_worker, 4, checkpoints, str(tmp_path / "saved"))
