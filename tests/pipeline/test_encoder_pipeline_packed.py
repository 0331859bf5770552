"""Packed documents through the native encoders under pipeline parallelism (issue 52): the restarting
``position_ids`` reach every stage (the encoder adapter's batch keys), each stage's layers attend within documents,
so a packed masked-LM batch at pp 2 (1F1B, 2 microbatches, ``train_step``) gives the loss, every gradient and the
parameters after 3 AdamW steps of ``transformers`` on the same documents one per row (fp32, 1e-5; then
``eval_step``'s loss): BERT (learned positions), ModernBERT (rotary, local window) and DeBERTa-v2 (relative c2p / p2c
buckets), the batch of ``tests/models/test_encoder_packing.py`` (rows of 2-3 documents, trailing padding, unequal
label counts). Negative control: the same rows without ``position_ids`` (documents see each other) fail. A flat
``cu_seqlens`` (which does not split by rows into microbatches) is refused with the keys a pipelined batch takes.
One spawned group of 2 gloo processes.
"""
from __future__ import annotations

import pytest

import oslo_models as om
from oslo_models.models.registry import family_record
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.pipeline import assert_pipeline_matches
from tests.models.test_encoder_packing import one_per_row, packed_batch, save

TYPES = ("bert", "modernbert", "deberta-v2")


def _pipelined(model_type, path):
    cls = family_record(model_type).model_class("masked_lm")
    parallel = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, pipeline_partition="parameters")
    model = cls.from_pretrained(path, parallel=parallel, progress=False).train()
    return model, cls.hf_twin.from_pretrained(path, attn_implementation="eager").train()


def _worker(paths):
    for model_type, path in paths.items():
        breadcrumb(f"{model_type} packed at pp2")
        model, reference = _pipelined(model_type, path)
        rows = one_per_row(model.config)
        assert_pipeline_matches(model, reference, packed_batch(model.config),
                                reference_loss=lambda ref, _: ref(**rows).loss)
    breadcrumb("negative control: bert without position_ids")
    model, reference = _pipelined("bert", paths["bert"])
    rows = one_per_row(model.config)
    unmarked = {k: v for k, v in packed_batch(model.config).items() if k != "position_ids"}
    with pytest.raises(AssertionError):
        assert_pipeline_matches(model, reference, unmarked, steps=1, reference_loss=lambda ref, _: ref(**rows).loss)
    breadcrumb("cu_seqlens refused")
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.train_step(packed_batch(model.config, how="cu_seqlens"))


@pytest.mark.slow
def test_packed_encoders_under_pipeline_parallelism(tmp_path):
    paths = {model_type: save(tmp_path / model_type, model_type, "masked_lm") for model_type in TYPES}
    run_distributed(_worker, 2, paths, timeout=900)
