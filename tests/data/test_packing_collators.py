"""Packing collators: first-fit rows with the marks that keep documents apart, and training on them is training on the
documents one per row.

- ``first_fit`` places each document in the first row with room; ``CausalLMCollator(pack_to=N)`` emits restarting
  ``position_ids``, ``cu_seqlens`` (each row's padding a segment of its own), ``attention_mask`` and labels -100 on
  every document's first token and on padding; a long document is cut into pieces of ``N``; ``SFTCollator`` masks
  prompts, padded or packed (long examples truncated), from ``prompt_ids``/``completion_ids`` or TRL's
  ``completion_mask``; the context-parallel splitter drops ``cu_seqlens`` (its positions carry the documents).
- Parity (fp32, 1e-5, single process): the packed batch gives the loss and every gradient of the same examples
  padded one per row, for CLM through a native Llama and for SFT through a generic-path Granite. Negative control:
  the packed batch with its document marks removed (library code on a batch that no longer says where documents
  start) is far off.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import oslo_models as om
from oslo_models.data import CausalLMCollator, ContextParallelSplitter, SFTCollator, first_fit
from tests.generic.models import CONFIGS
from tests.helpers.decoders import tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)


def test_first_fit_and_packed_causal_batch():
    assert first_fit([5, 7, 3, 4, 6, 2], 10) == [[0, 2, 5], [1], [3, 4]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit([11], 10)
    docs = [np.arange(10, 15), np.arange(20, 27), np.arange(30, 33)]
    batch = CausalLMCollator(pack_to=10)(docs)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 30, 31, 32, 0, 0],
                                           [20, 21, 22, 23, 24, 25, 26, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 11, 12, 13, 14, -100, 31, 32, -100, -100],
                                        [-100, 21, 22, 23, 24, 25, 26, -100, -100, -100]]
    assert batch["attention_mask"].sum(-1).tolist() == [8, 7]
    assert batch["cu_seqlens"].tolist() == [0, 5, 8, 10, 17, 20]
    long = CausalLMCollator(pack_to=4, return_cu_seqlens=False)([np.arange(1, 11)])
    assert long["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]] and "cu_seqlens" not in long
    split = ContextParallelSplitter(cp_rank=0, cp_size=1, mode="all_to_all")(batch)
    assert "cu_seqlens" not in split and torch.equal(split["position_ids"], batch["position_ids"])


def test_sft_collator_masks_prompts_padded_and_packed():
    examples = [{"prompt_ids": [5, 6], "completion_ids": [7, 8, 9]},
                {"input_ids": [11, 12, 13, 14], "completion_mask": [0, 0, 0, 1]}]
    padded = SFTCollator(pad_token_id=0)(examples)
    assert padded["input_ids"].tolist() == [[5, 6, 7, 8, 9], [11, 12, 13, 14, 0]]
    assert padded["labels"].tolist() == [[-100, -100, 7, 8, 9], [-100, -100, -100, 14, -100]]
    assert padded["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 1, 0]]
    packed = SFTCollator(pack_to=10)(examples)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 11, 12, 13, 14, 0]]
    assert packed["labels"].tolist() == [[-100, -100, 7, 8, 9, -100, -100, -100, 14, -100]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]]
    assert SFTCollator(pack_to=4)(examples[:1])["labels"].tolist() == [[-100, -100, 7, 8]]  # truncated to 4
    with pytest.raises(ValueError, match="prompt_ids"):
        SFTCollator()([{"text": "no ids"}])


def _documents(vocab: int, lengths, seed: int = 7):
    gen = np.random.default_rng(seed)
    return [gen.integers(3, vocab, n) for n in lengths]


def _loss_and_grads(model, batch):
    model.zero_grad()
    count = int((batch["labels"][:, 1:] != -100).sum())
    loss = model(**batch, num_items_in_batch=count).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(packed, padded, what):
    torch.testing.assert_close(packed[0], padded[0], **TOL, msg=lambda m: f"{what} loss: {m}")
    for name, grad in padded[1].items():
        torch.testing.assert_close(packed[1][name], grad, **TOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def test_packed_batches_train_like_padded_rows():
    torch.manual_seed(0)
    llama = om.AutoModelForCausalLM.from_config(tiny_config("llama")).train()
    docs = _documents(101, [5, 9, 3, 7, 4, 8])
    packed = CausalLMCollator(pack_to=16)(docs)
    assert packed["input_ids"].shape[0] < len(docs)  # really packed: 6 documents in fewer rows
    reference = _loss_and_grads(llama, CausalLMCollator(pad_token_id=0)(docs))
    _assert_same(_loss_and_grads(llama, packed), reference, "clm")
    for key in ("cu_seqlens", "position_ids"):  # either mark alone keeps the documents apart
        _assert_same(_loss_and_grads(llama, {k: v for k, v in packed.items() if k != key}), reference, f"clm -{key}")
    unmarked = {k: v for k, v in packed.items() if k not in ("cu_seqlens", "position_ids")}
    assert (_loss_and_grads(llama, unmarked)[0] - reference[0]).abs() > 1e-4  # negative control: documents leak

    torch.manual_seed(0)
    granite = om.AutoModelForCausalLM.from_config(CONFIGS["granite"]()).train()
    assert type(granite).__module__.startswith("transformers.")
    prompts, completions = _documents(101, [3, 4, 2, 5], 1), _documents(101, [4, 2, 6, 3], 2)
    examples = [{"prompt_ids": p, "completion_ids": c} for p, c in zip(prompts, completions)]
    reference = _loss_and_grads(granite, SFTCollator(pad_token_id=0)(examples))
    _assert_same(_loss_and_grads(granite, SFTCollator(pack_to=16)(examples)), reference, "sft")


@pytest.mark.slow
def test_train_clm_pack(tmp_path):
    """``examples/train_clm.py --pack`` trains on packed documents (native Llama, single process); under ``--pp``
    the packed rows come in a multiple of the microbatches."""
    import json
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_clm.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, script, "--pack", "--steps", "3", "--seq-len", "64", "--batch-size", "8",
            "--model-type", "llama", "--output", str(tmp_path / "out")]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "out" / "loss.json", encoding="utf-8") as handle:
        losses = json.load(handle)
    assert len(losses if isinstance(losses, list) else losses["losses"]) == 3
    # under pp (no longer refused): rows padded to a multiple of the microbatches, no cu_seqlens (tests/training/
    # test_sft_example.py trains packed rows at pp 2 through the same options)
    sys.path.insert(0, os.path.dirname(script))
    import train_clm

    options = train_clm.packing_options(train_clm.parse_args(["--pack"]),
                                        om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=4))
    assert options == {"pack_to": 64, "rows_multiple_of": 4, "return_cu_seqlens": False}


def test_rows_padded_to_a_multiple_add_nothing():
    """``rows_multiple_of``: empty rows (pipeline microbatches) leave loss and gradients those of the padded rows, for
    a native Llama and a generic-path Granite, with and without ``cu_seqlens``. Negative control: an appended row
    that is not empty (its padding labelled) changes the loss."""
    docs = _documents(101, [5, 9, 3, 7, 4, 8])
    batch = CausalLMCollator(pack_to=16, rows_multiple_of=4)(docs)
    assert batch["input_ids"].shape == (4, 16) and batch["attention_mask"][-1].sum() == 0
    assert (batch["labels"][-1] == -100).all() and batch["cu_seqlens"].tolist()[-2:] == [48, 64]
    assert CausalLMCollator(pack_to=16, rows_multiple_of=1)(docs)["input_ids"].shape[0] == 3
    with pytest.raises(ValueError, match="rows_multiple_of"):
        CausalLMCollator(pack_to=16, rows_multiple_of=0)(docs)
    torch.manual_seed(0)
    models = {"llama": om.AutoModelForCausalLM.from_config(tiny_config("llama")).train(),
              "granite": om.AutoModelForCausalLM.from_config(CONFIGS["granite"]()).train()}
    for name, model in models.items():
        reference = _loss_and_grads(model, CausalLMCollator(pad_token_id=0)(docs))
        for marks in (True, False):
            rows = CausalLMCollator(pack_to=16, rows_multiple_of=4, return_cu_seqlens=marks)(docs)
            _assert_same(_loss_and_grads(model, rows), reference, f"{name} cu_seqlens={marks}")
    rows = CausalLMCollator(pack_to=16, rows_multiple_of=4, return_cu_seqlens=False)(docs)
    rows["labels"][-1, 1:] = 0
    rows["attention_mask"][-1] = 1
    padded = _loss_and_grads(models["llama"], CausalLMCollator(pad_token_id=0)(docs))[0]
    assert (_loss_and_grads(models["llama"], rows)[0] - padded).abs() > 1e-3
