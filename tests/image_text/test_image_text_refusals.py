"""Layouts image-text models do not run on yet are refused before any process group, with the reason; a type with
no image-text class is a clear ``ValueError``. No processes are started."""
from __future__ import annotations

import pytest
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.image_text.models import config


@pytest.mark.parametrize("options, words", [
    (dict(pipeline_parallel_size=2, context_parallel_size=2), "pipeline them with tensor and data parallelism"),
    (dict(expert_parallel_size=2, data_parallel_size=2), "expert_parallel_size=2"),
    (dict(tensor_parallel_size=2, sequence_parallel=True), "sequence_parallel"),
])
def test_refused_before_any_process_group(options, words):
    with pytest.raises(NotImplementedError, match=words):
        om.AutoModelForImageTextToText.from_config(config("llava"), parallel=om.ParallelConfig(**options))
    assert not dist.is_initialized()


def test_unknown_type_and_bad_option():
    with pytest.raises(ValueError, match="no AutoModelForImageTextToText class"):
        om.AutoModelForImageTextToText.from_config(transformers.GPT2Config())
    with pytest.raises(ValueError, match="freeze_vision"):
        om.AutoModelForImageTextToText.from_config(config("llava"), freeze_vision="yes")


def test_freeze_vision_single_process():
    model = om.AutoModelForImageTextToText.from_config(config("qwen2_5_vl"), freeze_vision=True)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    assert not any(name.startswith("model.visual.") for name, p in model.named_parameters() if p.requires_grad)
