"""Property-based fuzz (hypothesis): ``ParallelConfig`` x launched world x tiny model sizes.

Each example draws a layout (tp, pp, dp, sequence parallelism, schedule, microbatches, ZeRO stage), a world of 1, 2
or 4 processes and a tiny GPT-2 or BERT-MLM (heads, head size, layers, vocabulary, sequence length), saves the
``transformers`` model and launches the world. Every rank then builds the config, loads the checkpoint, runs one
training step (``model.train_step`` under pp, ZeRO/DDP through ``shard_data_parallel`` otherwise, identical batches
on every data-parallel replica) and one SGD step. The property:

- either every rank succeeds with the single-process ``transformers`` loss and parameters after the step (SGD, so
  the parameters carry the gradients), fp32 atol 1e-5;
- or every rank raises the same ``ValueError`` / ``NotImplementedError`` with the same message;
- never a hang (each world has a short timeout) and never another exception (a failure inside a collective).

Layouts that ``ParallelConfig``, the world-size check or the family's size checks refuse are checked in the parent
(pure functions of the configs and the world size, run on every rank before any collective); the others launch.

``make test`` runs a few derandomized examples; ``OSLO_FUZZ_EXAMPLES=200`` runs more, with fresh random draws.
"""
from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import transformers

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import oslo_models as om  # noqa: E402
from oslo_models import training  # noqa: E402
from tests.helpers.dist import run_distributed  # noqa: E402
from tests.helpers.models import expected_shard  # noqa: E402

EXAMPLES = int(os.environ.get("OSLO_FUZZ_EXAMPLES", "10"))
CLEAR_ERRORS = (ValueError, NotImplementedError)
FAMILIES = {"gpt2": (transformers.GPT2LMHeadModel, om.AutoModelForCausalLM),
            "bert": (transformers.BertForMaskedLM, om.AutoModelForMaskedLM)}


@st.composite
def cases(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    heads, head_dim = draw(st.integers(1, 4)), draw(st.sampled_from([2, 4]))
    model = dict(family=family, heads=heads, hidden=heads * head_dim, layers=draw(st.integers(1, 4)),
                 vocab=draw(st.integers(17, 40)), seq=draw(st.sampled_from([4, 6, 8])), batch=4)
    tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 1, 2]))
    parallel = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, sequence_parallel=draw(st.booleans()),
                    pipeline_schedule=draw(st.sampled_from(["1f1b", "gpipe"])),
                    num_microbatches=draw(st.sampled_from([None, 1, 2, 4])),
                    zero_stage=draw(st.sampled_from([0, 1, 2, 3])))
    dp = draw(st.sampled_from([None, 1, 2]))
    if dp is not None:
        parallel["data_parallel_size"] = dp
    # Mostly a world the layout fits (those runs are the expensive, interesting ones), sometimes any world.
    fitting = tp * pp * (dp or 1)
    world = fitting if fitting <= 4 and draw(st.integers(0, 3)) else draw(st.sampled_from([1, 2, 4]))
    return model, parallel, world


def _hf_config(model: dict):
    if model["family"] == "gpt2":
        return transformers.GPT2Config(n_embd=model["hidden"], n_layer=model["layers"], n_head=model["heads"],
                                       vocab_size=model["vocab"], n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0)
    return transformers.BertConfig(hidden_size=model["hidden"], num_hidden_layers=model["layers"],
                                   num_attention_heads=model["heads"], intermediate_size=2 * model["hidden"],
                                   vocab_size=model["vocab"], max_position_embeddings=16, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)


def _pure_error(model: dict, parallel: dict, world: int) -> Exception | None:
    """The error every rank raises before any collective, from pure functions of (configs, world size):
    ``ParallelConfig``, the world-size check and the family's size checks. No world is launched for these."""
    try:
        cfg = om.ParallelConfig(**parallel)
        cfg.resolve_data_parallel_size(world)
        config = _hf_config(model)
        FAMILIES[model["family"]][1].model_class_for(config).validate_parallel_config(config, cfg)
    except Exception as error:  # noqa: BLE001 - asserted to be a clear error by the caller
        return error
    return None


def _save_checkpoint(path: str, model: dict) -> str:
    torch.manual_seed(0)
    FAMILIES[model["family"]][0](_hf_config(model)).save_pretrained(path)
    return path


def _batch(model: dict) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, model["vocab"], (model["batch"], model["seq"]), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.roll(1, dims=1)}


def _train_and_compare(path: str, model_spec: dict, parallel: dict) -> None:
    hf_cls, auto = FAMILIES[model_spec["family"]]
    cfg = om.ParallelConfig(**parallel)
    model = auto.from_pretrained(path, parallel=cfg, progress=False).train()
    batch = _batch(model_spec)
    model, optimizer = training.shard_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.5))
    if cfg.pipeline_parallel_size > 1:
        loss = model.train_step(batch)  # runs the schedule, averages gradients over dp
    else:
        loss = model(**batch).loss
        loss.backward()
    optimizer.step()

    reference = hf_cls.from_pretrained(path).train()
    expected = reference(**batch).loss
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    inner = training.unwrap_model(model)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in inner.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        torch.testing.assert_close(value.detach(), expected_shard(inner, name, ref_params[name].detach()),
                                   atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def _worker(path: str, model_spec: dict, parallel: dict, out_dir: str) -> None:
    """Runs on every rank; never raises: writes ``ok`` or the exception to ``out_dir/<rank>.json``."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        _train_and_compare(path, model_spec, parallel)
        result = {"outcome": "ok"}
    except CLEAR_ERRORS as error:
        result = {"outcome": "clear", "type": type(error).__name__, "message": str(error)}
    except Exception as error:  # noqa: BLE001 - reported to the parent, which fails the example
        result = {"outcome": "other", "type": type(error).__name__, "message": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as handle:
        json.dump(result, handle)


# No shrinking: every shrink step launches a world; the failing example is reported as drawn.
@settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize="OSLO_FUZZ_EXAMPLES" not in os.environ,
          phases=(Phase.explicit, Phase.generate), report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(case=cases())
@example(case=({"family": "bert", "heads": 2, "hidden": 4, "layers": 2, "vocab": 23, "seq": 6, "batch": 4},
               {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True,
                "pipeline_schedule": "gpipe", "num_microbatches": 2, "zero_stage": 1}, 4))  # always one pp x tp world
def test_any_layout_succeeds_with_parity_or_fails_alike_on_every_rank(case, tmp_path_factory):
    model_spec, parallel, world = case
    where = f"{model_spec} {parallel} world={world}"
    error = _pure_error(model_spec, parallel, world)
    if error is not None:
        assert isinstance(error, CLEAR_ERRORS), f"{where}: {type(error).__name__}: {error}"
        return
    root = str(tmp_path_factory.mktemp("fuzz"))
    path = _save_checkpoint(os.path.join(root, "model"), model_spec)
    out_dir = os.path.join(root, "results")
    os.makedirs(out_dir)
    # A hang fails after 240 s: generous, as 4 processes importing torch take over 90 s on a loaded 2-core box.
    run_distributed(_worker, world, path, model_spec, parallel, out_dir, timeout=240)
    results = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"{rank}.json")) as handle:
            results.append(json.load(handle))
    others = [r for r in results if r["outcome"] == "other"]
    assert not others, f"{where}: an unclear failure:\n{others[0]['message']}"
    assert all(r == results[0] for r in results), f"{where}: ranks disagree: {results}"
    if os.environ.get("OSLO_FUZZ_VERBOSE"):
        print(f"\n{where}: {results[0]['outcome']} {results[0].get('message', '')[:200]}", flush=True)
