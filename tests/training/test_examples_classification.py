"""examples/train_classification.py: a smoke run at tp=2 over 2 CPU processes on the built-in data (it trains,
reports held-out loss, accuracy and F1 to the jsonl tracker, and saves a Hub folder that plain ``transformers``'
``pipeline("text-classification")`` runs with the run's class names, scoring the held-out rows as the script
reported), and the evaluator's accuracy and macro F1 against an independent count in one process."""
from __future__ import annotations

import csv
import math
import sys

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers import examples

sys.path.insert(0, examples.EXAMPLES)
import train_classification as script  # noqa: E402  (the examples folder is not a package)


def _held_out_rows() -> list[dict]:
    """The built-in data's held-out rows (the script's default: the last 20%)."""
    with open(script.BUILTIN_DATA, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return rows[int(len(rows) * 0.8):]


def test_classification_example_tp2(tmp_path):
    out = tmp_path / "out"
    result = examples.launch(examples.torchrun(2), "train_classification.py", "--tp", "2", "--steps", "4",
                             "--eval-every", "2", "--n-embd", "32", "--batch-size", "8", "--seq-len", "24",
                             "--output", str(out), "--report-to", "jsonl", timeout=240)
    assert "held-out accuracy" in result.stdout
    report, metrics = examples.read_run(out)
    assert len(report["losses"]) == 4 and all(math.isfinite(x) for x in report["losses"])
    evaluated = [m for m in metrics if "eval/accuracy" in m]
    assert [m["step"] for m in evaluated] == [2, 4] and all("eval/f1" in m for m in evaluated)

    model_dir = str(out / "model")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.id2label == {0: "negative", 1: "positive"} and config.label2id == {"negative": 0, "positive": 1}
    classify = transformers.pipeline("text-classification", model=model_dir, device="cpu")
    rows = _held_out_rows()
    predictions = classify([row["text"] for row in rows], truncation=True, max_length=24)
    assert {p["label"] for p in predictions} <= {"negative", "positive"}
    accuracy = sum(p["label"] == row["label"] for p, row in zip(predictions, rows)) / len(rows)
    # the script's last evaluation (the parallel model, before saving) scored the same rows
    assert report["eval"][-1]["accuracy"] == pytest.approx(accuracy, abs=1e-9)


def _macro_f1(truth: list[int], predicted: list[int]) -> float:
    values = []
    for label in sorted(set(truth) | set(predicted)):
        tp = sum(t == p == label for t, p in zip(truth, predicted))
        fp = sum(p == label != t for t, p in zip(truth, predicted))
        fn = sum(t == label != p for t, p in zip(truth, predicted))
        values.append(2 * tp / (2 * tp + fp + fn))
    return sum(values) / len(values)


def test_evaluator_scores_single_process():
    """Accuracy and macro F1 of ``ClassificationEvaluator`` equal a count over the model's own argmax (odd row count:
    the last batch is partial); ``scores`` on a known confusion matrix."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, num_labels=3)
    model = om.AutoModelForSequenceClassification.from_config(config)
    generator = torch.Generator().manual_seed(3)
    tensors = dict(input_ids=torch.randint(1, 50, (13, 6), generator=generator),
                   attention_mask=torch.ones(13, 6, dtype=torch.long),
                   labels=torch.randint(0, 3, (13,), generator=generator))
    result = script.ClassificationEvaluator(tensors, 3, 4, model.parallel_context)(model)
    with torch.no_grad():
        outputs = model.eval()(**tensors)
    predicted = outputs.logits.argmax(-1).tolist()
    truth = tensors["labels"].tolist()
    assert result["samples"] == 13
    assert result["accuracy"] == pytest.approx(sum(p == t for p, t in zip(predicted, truth)) / 13)
    assert result["f1"] == pytest.approx(_macro_f1(truth, predicted))
    assert result["loss"] == pytest.approx(float(outputs.loss), abs=1e-6)
    scores = script.scores(torch.tensor([[5.0, 1.0], [2.0, 2.0]]))
    assert scores["accuracy"] == pytest.approx(0.7)
    assert scores["f1"] == pytest.approx((10 / 13 + 4 / 7) / 2)
