"""``GlobalBatchLoader`` in one process: the window's count, Accelerate's accumulation boundaries, the label rules,
an all-masked batch, checkpoints between windows only. The multi-process parity is ``test_global_batch_loss.py``."""
from __future__ import annotations

import pytest
import torch
import transformers

from oslo_models.distributed.context import ParallelContext
from oslo_models.training.global_batch import (
    GlobalBatchLoader,
    count_label_tokens,
    loss_is_per_token,
    loss_shifts_labels,
)


def _batch(labels: list[list[int]]) -> dict:
    labels = torch.tensor(labels)
    return dict(input_ids=labels.clamp(min=0), labels=labels)


BATCHES = [_batch([[5, 6, -100], [7, -100, -100]]), _batch([[5, 6, 7], [5, 6, 7]]), _batch([[-100, -100, -100],
                                                                                            [-100, 4, 4]])]


def test_label_rules_follow_transformers():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2))
    classifier = transformers.BertForSequenceClassification(bert.config)
    assert loss_shifts_labels(llama) and not loss_shifts_labels(bert) and not loss_shifts_labels(classifier)
    assert loss_is_per_token(llama) and loss_is_per_token(bert) and not loss_is_per_token(classifier)
    # a ...ForCausalLM whose forward averages a plain CrossEntropyLoss without shifting (BART's decoder alone), on the
    # transformers class and on the native twin, which says so itself
    bart_config = transformers.BartConfig(vocab_size=16, d_model=8, encoder_layers=1, decoder_layers=1,
                                          encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=8,
                                          decoder_ffn_dim=8)
    from oslo_models import BartForCausalLM

    assert not loss_shifts_labels(transformers.BartForCausalLM(bart_config))
    assert not loss_shifts_labels(BartForCausalLM(bart_config))
    # causal: the first column is never a target; shift_labels (cp, packing) are counted as they are
    assert int(count_label_tokens(BATCHES[:1], shifts_labels=True)) == 1
    assert int(count_label_tokens(BATCHES[:1], shifts_labels=False)) == 3
    shifted = dict(BATCHES[0], shift_labels=torch.tensor([[1, 1, 1], [-100, -100, -100]]))
    assert int(count_label_tokens([shifted], shifts_labels=True)) == 3
    # sequence-level labels: no count
    assert count_label_tokens([dict(input_ids=torch.ones(2, 3), labels=torch.tensor([0, 1]))],
                              shifts_labels=False) is None


def test_window_share_and_accumulation_boundaries():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(1, 1)
    context = ParallelContext.single_process()
    loader = GlobalBatchLoader(BATCHES, context=context, shifts_labels=False, accumulation_steps=2)
    shares, syncs = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            shares.append(float(batch["num_items_in_batch"]))
            syncs.append(accelerator.sync_gradients)
    # window 1: 3 + 6 labels over 2 micro-steps; window 2 (short, the epoch's end): 2 labels, still / 2 because
    # accelerator.backward divides every micro-step by 2
    assert shares == [4.5, 4.5, 1.0]
    assert syncs == [False, True, True]
    # the per-replica option: each batch's own count, nothing shared
    own = [float(b["num_items_in_batch"]) for b in GlobalBatchLoader(
        BATCHES, context=context, shifts_labels=False, accumulation_steps=2, average_tokens_across_devices=False)]
    assert own == [3.0, 6.0, 2.0]


def test_a_batch_with_no_label_gives_loss_zero():
    from oslo_models import LlamaForCausalLM

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2)
    model = LlamaForCausalLM(config)
    empty = dict(input_ids=torch.ones(2, 4, dtype=torch.long), labels=torch.full((2, 4), -100))
    (batch,) = list(GlobalBatchLoader([empty], context=ParallelContext.single_process(), shifts_labels=True))
    assert float(batch["num_items_in_batch"]) == 1.0  # the divisor is at least 1
    loss = model(**batch).loss
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_checkpoint_between_windows_only():
    class Resumable(list):
        def state_dict(self):
            return {"position": 0}

    loader = GlobalBatchLoader(Resumable(BATCHES), context=ParallelContext.single_process(), shifts_labels=False,
                               accumulation_steps=2)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(ValueError, match="save a checkpoint after an optimizer step"):
        loader.state_dict()
    next(iterator)
    assert loader.state_dict() == {"position": 0}
