"""The planner's memory model counts the long-sequence tools (``planner/memory.py``): the tiled MLP
(``ParallelConfig.tiled_mlp``: no ``[s, ffn]`` term), the tiled loss (``skip_logits=True``: no ``[s, V]`` logits)
and activation offload (the blocks' share in ``host``), each within 10% of what the saved-tensor hooks see in one
forward of a tiny Llama (single process), as the checkpointing modes are (``test_planner.py``). Negative control:
the model without the tools' terms (the plain prediction) misses the tiled runs by more than 10% (15-60%).
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.planner.facts import ModelFacts
from oslo_models.planner.measured import saved_activation_bytes
from oslo_models.planner.memory import activation_bytes, estimate_memory, offloaded_activation_bytes
from tests.helpers.zoo import tiny_config

SEQ, ROWS = 96, 2


def _measured_and_predicted(tiled_mlp=None, tiled_loss=False, activation_checkpointing=None):
    config = tiny_config("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=352, vocab_size=2000)
    parallel = om.ParallelConfig(tiled_mlp=tiled_mlp, activation_checkpointing=activation_checkpointing)
    torch.manual_seed(0)
    model = om.LlamaForCausalLM.from_config(config, parallel=parallel).train()
    ids = torch.randint(1, config.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids, **({"skip_logits": True} if tiled_loss else {})}
    saved = saved_activation_bytes(model, batch)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    predicted = activation_bytes(facts, parallel, micro_batch=ROWS, seq_len=SEQ, num_microbatches=1,
                                 tiled_loss=tiled_loss)
    plain = activation_bytes(facts, om.ParallelConfig(activation_checkpointing=activation_checkpointing),
                             micro_batch=ROWS, seq_len=SEQ, num_microbatches=1)
    return saved, predicted, plain


@pytest.mark.parametrize("tiled_mlp, tiled_loss, checkpointing", [(4, False, None), (None, True, None),
                                                                   ("auto", True, None), (4, True, "full")])
def test_tools_within_ten_percent_of_saved_tensors(tiled_mlp, tiled_loss, checkpointing):
    saved, predicted, plain = _measured_and_predicted(tiled_mlp, tiled_loss, checkpointing)
    assert abs(predicted - saved) <= 0.1 * saved, (predicted, saved)
    if checkpointing is None:  # negative control: the plain model's count fails the same check
        assert abs(plain - saved) > 0.1 * saved, (plain, saved)


def test_offload_moves_the_blocks_share_to_host():
    config = tiny_config("llama", num_hidden_layers=4, hidden_size=64, intermediate_size=352, vocab_size=2000)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    plain, offload = om.ParallelConfig(), om.ParallelConfig(activation_offload=True, tiled_mlp=4)
    options = dict(micro_batch=ROWS, seq_len=SEQ, num_microbatches=1)
    estimate = estimate_memory(facts, offload, 1, **options)
    moved = offloaded_activation_bytes(facts, offload, **options)
    assert estimate.host == moved > 0 and offloaded_activation_bytes(facts, plain, **options) == 0
    # the device keeps what is outside the blocks (embeddings, final norm, logits); the blocks' share is on the host
    assert estimate.activations + moved == activation_bytes(facts, om.ParallelConfig(tiled_mlp=4), **options)
    assert estimate.activations < activation_bytes(facts, plain, **options) / 2
    # the tiled MLP's backward recomputes one slice: a transient in buffers (none without tiling or checkpointing)
    assert estimate.buffers > 0
    assert estimate_memory(facts, om.ParallelConfig(activation_offload=True), 1, **options).buffers == 0
