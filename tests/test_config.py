"""ParallelConfig validation and (de)serialization: pure logic, no processes."""
from __future__ import annotations

import json

import pytest

import oslo_models as om


def test_round_trip_dict_and_json(tmp_path):
    cfg = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2, zero_stage=1)
    assert om.ParallelConfig.from_dict(cfg.to_dict()) == cfg
    path = tmp_path / "parallel.json"
    cfg.to_json(path)
    assert om.ParallelConfig.from_json(path) == cfg
    assert om.ParallelConfig.from_json(json.dumps(cfg.to_dict())) == cfg


def test_frozen():
    with pytest.raises(Exception):
        om.ParallelConfig().tensor_parallel_size = 4


def test_unknown_option_names_the_closest_field():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        om.ParallelConfig.from_dict({"tensor_paralel_size": 2})


@pytest.mark.parametrize("bad", [
    {"tensor_parallel_size": 0}, {"tensor_parallel_size": 1.5}, {"tensor_parallel_size": True},
    {"tensor_parallel_mode": "4d"}, {"pipeline_schedule": "1f2b"}, {"zero_stage": 4},
    {"sequence_parallel": "yes"}, {"num_microbatches": 0},
])
def test_bad_values_raise_value_error(bad):
    with pytest.raises(ValueError):
        om.ParallelConfig(**bad)


@pytest.mark.parametrize("unimplemented,name", [
    ({"tensor_parallel_mode": "2d", "tensor_parallel_size": 4, "expert_parallel_size": 2}, "expert_parallel_size"),
])
def test_unimplemented_dimensions_say_so(unimplemented, name):
    with pytest.raises(NotImplementedError, match=name):
        om.ParallelConfig(**unimplemented)


def test_data_parallel_size_is_inferred_and_checked():
    cfg = om.ParallelConfig(tensor_parallel_size=2)
    assert cfg.resolve_data_parallel_size(8) == 4
    with pytest.raises(ValueError, match="launched world has 3"):
        cfg.resolve_data_parallel_size(3)
    with pytest.raises(ValueError, match="= 4"):
        om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2).resolve_data_parallel_size(2)


def test_expert_parallel_size_is_carved_out_of_data_parallel():
    cfg = om.ParallelConfig(expert_parallel_size=4, tensor_parallel_size=2)
    assert cfg.resolve_data_parallel_size(8) == 4
    with pytest.raises(ValueError, match="expert_parallel_size=4 must divide data_parallel_size=2"):
        cfg.resolve_data_parallel_size(4)
    with pytest.raises(ValueError, match="must divide"):
        om.ParallelConfig(expert_parallel_size=2, data_parallel_size=3)


def test_hf_style_plan_is_published():
    plan = om.GPT2Config.base_model_tp_plan
    assert plan["h.*.attn.c_attn"] == "packed_colwise"
    assert plan["h.*.attn.c_proj"] == "rowwise"
    assert plan["wte"] == "embedding_rowwise"
    assert "base_model_tp_plan" not in om.GPT2Config().to_dict()  # never leaks into config.json
