"""examples/train_sft.py: supervised fine-tuning on prompt/response pairs, the prompt masked from the loss.

- Under torchrun at 2 processes (native Llama, the built-in set, 3 AdamW steps): dp 2 with one padded sample per row,
  dp 2 with the samples packed first-fit, and pp 2 (2 microbatches) packed with twice the per-rank batch (the same
  global batch: the sampler's global order does not depend on dp) log the same losses (1e-5) and save the same
  parameters (1e-5, read back with plain ``transformers``); the dp 2 runs' held-out losses are equal. The generic
  path (Granite, ``transformers``' own class): dp 2 padded and pp 2 packed, the same.
- In one process, no launcher: the script's packed batch of the built-in samples gives the padded batch's loss and
  gradients; negative control: the packed batch without its document marks (``position_ids``, ``cu_seqlens``) is far
  off (the samples of a row see each other). Under pp the packed rows come in a multiple of the microbatches, without
  ``cu_seqlens``. A JSONL line without the response field is a usage error naming the line.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import transformers

import oslo_models as om
from tests.helpers import examples


def _script():
    """The script's module (its folder is on ``sys.path`` when the scripts run)."""
    if examples.EXAMPLES not in sys.path:
        sys.path.insert(0, examples.EXAMPLES)
    import train_sft

    return train_sft

COMMON = ("--steps", "3", "--seq-len", "64", "--n-embd", "64", "--eval-samples", "16", "--report-to", "jsonl")


def _run(tmp_path, name: str, *args: str) -> tuple[list[float], list[dict], dict]:
    out = tmp_path / name
    examples.launch(examples.torchrun(2), "train_sft.py", *COMMON, *args, "--output", str(out), timeout=600)
    report, metrics = examples.read_run(out)
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    return report["losses"], [m["eval/loss"] for m in metrics if "eval/loss" in m], saved


def _assert_same_run(run, reference, what: str, evaluation: bool = True):
    torch.testing.assert_close(torch.tensor(run[0]), torch.tensor(reference[0]), rtol=0, atol=1e-5,
                               msg=lambda m: f"{what} losses: {m}")
    if evaluation:
        assert run[1] == pytest.approx(reference[1], abs=1e-5), what
    for name, tensor in reference[2].items():
        torch.testing.assert_close(run[2][name], tensor, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.slow
def test_packed_and_pipelined_runs_equal_the_padded_run(tmp_path):
    padded = _run(tmp_path, "padded", "--batch-size", "4")
    assert len(padded[0]) == 3 and len(padded[1]) == 1
    _assert_same_run(_run(tmp_path, "packed", "--batch-size", "4", "--pack"), padded, "dp2 packed")
    # one replica with the global batch: its held-out loss averages other batches (a mean of batch means)
    _assert_same_run(_run(tmp_path, "pp2", "--batch-size", "8", "--pack", "--pp", "2", "--microbatches", "2"),
                     padded, "pp2 packed", evaluation=False)


@pytest.mark.slow
def test_generic_path_packed_under_a_pipeline(tmp_path):
    padded = _run(tmp_path, "padded", "--model-type", "granite", "--batch-size", "4")
    pipelined = _run(tmp_path, "pp2", "--model-type", "granite", "--batch-size", "8", "--pack", "--pp", "2",
                     "--microbatches", "2")
    _assert_same_run(pipelined, padded, "granite pp2 packed", evaluation=False)


def _loss_and_grads(model, batch):
    model.zero_grad()
    count = int((batch["labels"][:, 1:] != -100).sum())
    loss = model(**batch, num_items_in_batch=count).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_script_batches_pack_exactly(tmp_path):
    from tests.helpers.decoders import tiny_config

    train_sft = _script()
    from _common import UsageError

    args = train_sft.parse_args(["--seq-len", "64", "--pack", "--output", str(tmp_path)])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(train_sft), eos_token="<eos>", pad_token="<eos>")
    samples = train_sft.PromptResponses(train_sft.builtin_pair, 12, tokenizer)
    batch = [samples[i] for i in range(12)]
    packed = train_sft.make_collator(args, om.ParallelConfig(), tokenizer, pack=True)(batch)
    padded = train_sft.make_collator(args, om.ParallelConfig(), tokenizer, pack=False)(batch)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0] and "cu_seqlens" in packed
    assert int((packed["labels"] != -100).sum()) == int((padded["labels"] != -100).sum())
    torch.manual_seed(0)
    model = om.AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).train()
    reference = _loss_and_grads(model, padded)
    loss, grads = _loss_and_grads(model, packed)
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, reference[1]):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)
    unmarked = {k: v for k, v in packed.items() if k not in ("position_ids", "cu_seqlens")}
    assert (_loss_and_grads(model, unmarked)[0] - reference[0]).abs() > 1e-3  # negative control: samples leak

    pipelined = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=4)
    rows = train_sft.make_collator(args, pipelined, tokenizer, pack=True)(batch)
    assert rows["input_ids"].shape[0] % 4 == 0 and "cu_seqlens" not in rows
    assert int((rows["labels"] != -100).sum()) == int((packed["labels"] != -100).sum())
    fixed = train_sft.make_collator(args, pipelined, tokenizer, pack=False)(batch)
    assert fixed["input_ids"].shape == (12, 64)  # static stage shapes under pp

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    with pytest.raises(UsageError, match=f"{os.path.basename(bad)}:2"):
        train_sft.read_jsonl(str(bad), "prompt", "response")


def _word_tokenizer(train_sft):
    """A word-level tokenizer over the built-in set's words (no training, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for i in range(300) for text in train_sft.builtin_pair(i) for w in
                    text.replace("?", " ?").replace(".", " .").replace(":", " :").split()})
    names = ["<eos>", "<unk>", "###", "Question", "Answer"] + [w for w in words if w not in ("###", "Question",
                                                                                            "Answer")]
    vocab = {w: i for i, w in enumerate(names)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    return tokenizer
