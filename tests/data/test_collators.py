"""Causal-LM, seq2seq and sequence-parallel collation: exact tensors, HF conventions, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oslo_models.data import CausalLMCollator, Seq2SeqCollator, SequenceParallelSplitter
from oslo_models.data.collators import shift_right


def test_causal_pads_and_masks_labels():
    batch = CausalLMCollator(pad_token_id=0, return_position_ids=True)(
        [{"input_ids": [5, 6, 7]}, {"input_ids": np.array([8])}, torch.tensor([9, 10])])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7], [8, -100, -100], [9, 10, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0], [0, 1, 0]]
    assert all(t.dtype == torch.int64 for t in batch.values())


def test_causal_pad_id_zero_is_not_confused_with_padding():
    # id 0 is a real token here; labels must keep it
    batch = CausalLMCollator(pad_token_id=0)([[0, 0, 3], [0]])
    assert batch["labels"].tolist() == [[0, 0, 3], [0, -100, -100]]


def test_causal_packed_keeps_document_positions(bpe_tokenizer):
    ex = [{"input_ids": torch.tensor([1, 2, 3, 4]), "position_ids": torch.tensor([0, 1, 0, 1])}] * 2
    batch = CausalLMCollator(bpe_tokenizer, pad_to_multiple_of=8)(ex)
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"][0].tolist() == [0, 1, 0, 1, 0, 0, 0, 0]
    assert batch["input_ids"][0, 4:].tolist() == [bpe_tokenizer.pad_token_id] * 4


def test_causal_errors():
    with pytest.raises(ValueError, match="pad_token_id"):
        CausalLMCollator()([[1, 2], [3]])
    assert CausalLMCollator()([[1, 2], [3, 4]])["input_ids"].tolist() == [[1, 2], [3, 4]]  # no pad needed
    with pytest.raises(ValueError, match="max_length"):
        CausalLMCollator(pad_token_id=0, max_length=2)([[1, 2, 3]])
    with pytest.raises(ValueError, match="empty"):
        CausalLMCollator()([])


def test_seq2seq_matches_hf_shift_right(t5_tokenizer):
    from transformers.models.t5.modeling_t5 import T5Config, T5ForConditionalGeneration

    collate = Seq2SeqCollator(t5_tokenizer)
    batch = collate([{"input_ids": [10, 11, 12], "labels": [20, 21]}, {"input_ids": [13], "labels": [22, 23, 24]}])
    pad = t5_tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[10, 11, 12], [13, pad, pad]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[20, 21, -100], [22, 23, 24]]
    assert batch["decoder_input_ids"].tolist() == [[pad, 20, 21], [pad, 22, 23]]
    # the same as what a transformers T5 model builds from the labels itself
    cfg = T5Config(vocab_size=len(t5_tokenizer), d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2,
                   decoder_start_token_id=pad, pad_token_id=pad)
    model = T5ForConditionalGeneration(cfg)
    assert torch.equal(model._shift_right(batch["labels"]), batch["decoder_input_ids"])
    assert torch.equal(shift_right(batch["labels"], pad, pad), batch["decoder_input_ids"])


def test_splitter_slices_and_keeps_global_positions():
    seq = torch.arange(24).reshape(2, 12)
    batch = {"input_ids": seq, "labels": seq + 100, "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    parts = [SequenceParallelSplitter(tp_rank=r, tp_size=3)(batch) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), seq)
    assert torch.equal(torch.cat([p["labels"] for p in parts], 1), seq + 100)
    assert parts[1]["input_ids"].tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    assert parts[2]["position_ids"].tolist() == [[8, 9, 10, 11]] * 2
    assert parts[1]["attention_mask"].shape == (2, 12)
    assert "position_ids" not in batch  # the input batch is not modified


def test_splitter_shift_labels_loses_no_prediction():
    seq = torch.arange(8).reshape(1, 8)
    parts = [SequenceParallelSplitter(tp_rank=r, tp_size=2, shift_labels=True)({"input_ids": seq, "labels": seq})
             for r in range(2)]
    assert "labels" not in parts[0]
    assert parts[0]["shift_labels"].tolist() == [[1, 2, 3, 4]]  # position 3 predicts token 4 across the edge
    assert parts[1]["shift_labels"].tolist() == [[5, 6, 7, -100]]


def test_splitter_errors():
    class Ctx:
        tp_rank, tp_size = 1, 4

    with pytest.raises(ValueError, match="not divisible"):
        SequenceParallelSplitter(Ctx())({"input_ids": torch.zeros(2, 10, dtype=torch.long)})
    with pytest.raises(ValueError, match="tp_rank"):
        SequenceParallelSplitter(tp_rank=4, tp_size=4)
    with pytest.raises(ValueError, match="disagree"):
        SequenceParallelSplitter(tp_rank=0, tp_size=2)({"input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 6)})
