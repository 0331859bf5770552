"""Smoke runs of examples/train_mlm.py (BERT masked LM) and examples/train_seq2seq.py (T5 span corruption) at tp=2
and at pp=2 (pipelined train_step / eval_step) over 2 CPU processes: they train, write a loss curve, report
held-out loss to the jsonl tracker, and save a Hub folder that plain ``transformers`` loads, that gives the logits
the ``oslo_models`` model loaded from the same folder gives, and whose held-out loss (same masking / span
corruption, same batches) is the one the script reported."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers import examples


def _collator(script, tokenizer):
    if script == "train_mlm.py":
        return 32, om.data.MLMCollator(tokenizer, mlm_probability=0.15, whole_word_mask=False, seed=0)
    raw_len, _ = om.data.t5_lengths(32, 0.15, 3.0)
    return raw_len, om.data.T5SpanCorruptionCollator(tokenizer, noise_density=0.15, mean_noise_span_length=3.0,
                                                     seed=0, pad_to_multiple_of=None)


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2", "--microbatches", "2")], ids=["tp2", "pp2"])
@pytest.mark.parametrize("script, plain_cls, oslo_cls", [
    ("train_mlm.py", transformers.BertForMaskedLM, om.AutoModelForMaskedLM),
    ("train_seq2seq.py", transformers.T5ForConditionalGeneration, om.AutoModelForSeq2SeqLM),
])
def test_example_smoke(tmp_path, script, plain_cls, oslo_cls, layout):
    out = tmp_path / "out"
    result = examples.launch(examples.torchrun(2), script, *layout, "--steps", "4", *examples.TINY, "--output",
                             str(out), "--eval-data", examples.eval_file(tmp_path), "--eval-samples", "16",
                             "--report-to", "jsonl", timeout=240)
    assert "plain transformers" in result.stdout
    # pipelined runs: no abort at teardown (a gloo group freed during interpreter finalization once hung or aborted a
    # rank at exit; the mechanism is tested in test_teardown_frees_pipeline_groups_before_destroying below)
    assert "terminate called" not in result.stderr
    report, metrics = examples.read_run(out)
    losses = report["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert (out / "loss.png").stat().st_size > 1000
    assert [m["step"] for m in metrics if "eval/loss" in m] == [4]

    model_dir = out / "model"
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    plain = plain_cls.from_pretrained(model_dir).eval()
    sample_len, collator = _collator(script, tokenizer)
    expected = examples.plain_eval_loss(plain, str(out / "eval_corpus"), sample_len, collator, 4, 16)
    assert report["eval"][-1]["loss"] == pytest.approx(expected, abs=1e-5)

    oslo = oslo_cls.from_pretrained(str(model_dir), progress=False).eval()
    ids = tokenizer("Shall I compare thee to a summer's day?", return_tensors="pt")["input_ids"]
    kwargs = {"input_ids": ids}
    if plain.config.is_encoder_decoder:
        kwargs["decoder_input_ids"] = torch.tensor([[plain.config.decoder_start_token_id, *ids[0, :5].tolist()]])
    with torch.no_grad():
        expected, got = plain(**kwargs).logits, oslo(**kwargs).logits
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def _teardown_worker(path):
    import gc
    import sys

    sys.path.insert(0, examples.EXAMPLES)
    from _common import teardown

    def pipeline_objects():
        return [o for o in gc.get_objects() if type(o).__name__ in ("PipelineRunner", "PipelineStage")]

    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    ids = torch.randint(1, 101, (4, 8), generator=torch.Generator().manual_seed(0))
    model.train_step({"input_ids": ids, "labels": ids})
    del model  # as when main() returns: the model <-> runner cycle keeps the stages and their groups alive
    assert pipeline_objects(), "expected the runner cycle to outlive the last reference"
    teardown()
    assert not pipeline_objects() and not torch.distributed.is_initialized()


def test_teardown_frees_pipeline_groups_before_destroying(tmp_path):
    """The mechanism behind a clean exit: after the last reference to a pipelined model goes, its runner and stages
    (holding the pp and tied-copy process groups) live on in a reference cycle; ``teardown`` frees them and
    destroys the process groups while the interpreter is whole, not in its finalization."""
    from tests.helpers.dist import run_distributed
    from tests.helpers.models import save_tiny_gpt2

    run_distributed(_teardown_worker, 2, save_tiny_gpt2(tmp_path / "gpt2"), timeout=180)
