"""Activation checkpointing modes (``models/common/stack/checkpointing.py``) equal no checkpointing, dropout on.

For GPT-2, Llama, T5 (encoder-decoder), BERT (MLM) and Mixtral (MoE) at tp=1, GPT-2, Llama and T5 at tp=2 (SP off,
and GPT-2 with SP on), and GPT-2 pipelined (pp=2, 1F1B and zero-bubble): every mode gives the loss and every gradient of the run without checkpointing, from the same
default and tensor-parallel RNG states. Each mode must also really act, seen through what autograd saves: an
outer ``saved_tensors_hooks`` counts the bytes saved outside the modes' own hooks, which must drop from none to
selective to full, and from full to offload/partitioned by exactly the blocks' input hidden states. The
offload mode must hold a host copy of each block input, the partitioned mode ``1/tp`` of it on each rank, in
their own storage, and restoring (all-gathering) them must give that input back.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models.models.common.stack.checkpointing import OffloadedActivation, PartitionedActivation
from tests.helpers.checkpointing import disable_checkpointing, enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import mlm_batch, seq2seq_batch, tiny_bert_config, tiny_t5_config
from tests.helpers.models import padded_batch, tiny_gpt2_config

MODES = (None, "selective", "full", "offload", "partitioned")
P = 0.1


def _config(family: str):
    if family == "gpt2":
        return tiny_gpt2_config(n_layer=2, resid_pdrop=P, embd_pdrop=P, attn_pdrop=P)
    if family == "llama":
        return transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                        attention_dropout=P, max_position_embeddings=64)
    if family == "mixtral":
        return transformers.MixtralConfig(hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                          num_local_experts=4, num_experts_per_tok=2, attention_dropout=P,
                                          output_router_logits=True, router_aux_loss_coef=0.3)
    if family == "bert":
        return tiny_bert_config(hidden_dropout_prob=P, attention_probs_dropout_prob=P)
    return tiny_t5_config(dropout_rate=P)


def _build(family: str, **parallel):
    torch.manual_seed(0)  # every rank builds the same random weights
    auto = {"t5": om.AutoModelForSeq2SeqLM, "bert": om.AutoModelForMaskedLM}.get(family, om.AutoModelForCausalLM)
    return auto.from_config(_config(family), parallel=om.ParallelConfig(**parallel)).train()


def _batch(family: str) -> dict:
    if family in ("t5", "bert"):
        inputs, labels = seq2seq_batch() if family == "t5" else mlm_batch()
        return dict(inputs, labels=labels)
    ids, mask, labels = padded_batch(101, batch=3, seq=8)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of the tensors autograd saves under this (outermost) hook; the modes' own hooks hide theirs."""

    def __init__(self):
        self.nbytes = 0

        def pack(tensor):
            self.nbytes += tensor.numel() * tensor.element_size()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self) -> "_SavedBytes":
        super().__enter__()
        return self


def _run(model, batch, states, mode):
    torch.set_rng_state(states[0])
    model.parallel_context.rng.load_state_dict(states[1])
    model.set_activation_checkpointing(mode)
    model.zero_grad(set_to_none=True)
    with _SavedBytes() as saved:
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, saved.nbytes


def _block_input_bytes(model, batch) -> int:
    """Bytes of the positional tensor inputs of every checkpointed block on this rank: what the checkpoint saves
    through the offload/partitioned hooks (which move the first, the hidden states, and keep the others)."""
    total, handles = [0], []

    def count(_module, args):
        total[0] += sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))

    for module in model.modules():
        if isinstance(module, transformers.modeling_layers.GradientCheckpointingLayer):
            handles.append(module.register_forward_pre_hook(count))
    with torch.no_grad():
        model(**batch)
    for handle in handles:
        handle.remove()
    return total[0]


def check_modes(family: str, **parallel) -> None:
    model, batch = _build(family, **parallel), _batch(family)
    states = (torch.get_rng_state(), model.parallel_context.rng.state_dict())
    ref_loss, ref_grads, ref_saved = _run(model, batch, states, None)
    assert not torch.allclose(model(**batch).loss.detach(), ref_loss), "dropout is off"
    saved = {}
    for mode in MODES[1:]:
        loss, grads, saved[mode] = _run(model, batch, states, mode)
        where = f"{family} {parallel} {mode}"
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6, msg=lambda m: f"{where} loss: {m}")
        assert grads.keys() == ref_grads.keys(), where
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=name: f"{where} {n}: {m}")
    # What each mode keeps: selective drops the attention cores' tensors, full the blocks' insides, offload and
    # partitioned also take the block inputs out of plain autograd storage.
    assert ref_saved > saved["selective"] > saved["full"] > saved["offload"], (family, ref_saved, saved)
    moved = _block_input_bytes(model.eval(), batch)
    model.train()
    assert saved["full"] - saved["offload"] == moved, (family, saved, moved)
    splits = model.parallel_context.tp_size > 1 and not model.parallel_context.sequence_parallel
    assert saved["partitioned"] == saved["offload" if splits else "full"], (family, saved)
    model.set_activation_checkpointing(None)


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5", "bert", "mixtral"])
def test_modes_match_no_checkpointing_tp1(family):
    check_modes(family)
    check_stored(family, "offload")


def check_stored(family: str, mode: str, **parallel) -> None:
    """After the forward, each block's input hidden states are held once per block, in their own storage, as the
    mode's stored form (a host copy; this rank's ``1/tp`` piece), and restoring them gives the input back."""
    model, batch = _build(family, **parallel), _batch(family)
    inputs = []
    handles = [block.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach().clone()))
               for block in model.modules()
               if isinstance(block, transformers.modeling_layers.GradientCheckpointingLayer)]
    model.set_activation_checkpointing(mode)
    loss = model(**batch).loss
    for handle in handles:
        handle.remove()
    gc.collect()
    kind = OffloadedActivation if mode == "offload" else PartitionedActivation
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        stored = [obj for obj in gc.get_objects() if isinstance(obj, kind)]
    assert len(stored) == len(inputs), (mode, len(stored), len(inputs))
    tp = model.parallel_context.tp_size
    for item in stored:
        held = item.host if mode == "offload" else item.shard
        if mode == "partitioned":
            assert item.shape in {x.shape for x in inputs} and held.numel() == -(-item.numel // tp), held.shape
        else:
            assert held.device.type == "cpu" and held.shape in {x.shape for x in inputs}
        # its own storage: the full hidden states are not kept alive behind a view
        assert held.untyped_storage().nbytes() == held.numel() * held.element_size()
    restored = [item.restore() if mode == "offload" else item.gather(model.parallel_context.tp_group, tp)
                for item in stored]
    for x in inputs:  # every block input comes back exactly
        assert any(r.shape == x.shape and torch.equal(x, r) for r in restored), mode
    loss.backward()


def _pipeline_step(model, batch, states, mode):
    torch.set_rng_state(states[0])
    model.parallel_context.rng.load_state_dict(states[1])
    model.set_activation_checkpointing(mode)
    model.zero_grad(set_to_none=True)
    loss = model.train_step({"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]},
                            labels=batch["labels"])
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_pipeline(schedule: str) -> None:
    """Pipeline stages (pp=2) checkpoint their blocks with the same result, microbatches interleaved by the
    schedule (zero-bubble splits each backward into an input and a weight pass)."""
    model, batch = _build("gpt2", pipeline_parallel_size=2, pipeline_schedule=schedule, num_microbatches=3), _batch("gpt2")
    states = (torch.get_rng_state(), model.parallel_context.rng.state_dict())
    ref_loss, ref_grads = _pipeline_step(model, batch, states, None)
    for mode in ("full", "offload", "selective"):
        loss, grads = _pipeline_step(model, batch, states, mode)
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
        assert grads.keys() == ref_grads.keys() and grads
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=name: f"pp {schedule} {mode} {n}: {m}")


def _tp2_worker() -> None:
    for family in ("gpt2", "llama", "t5"):
        check_modes(family, tensor_parallel_size=2)
        check_stored(family, "partitioned", tensor_parallel_size=2)
    # Sequence parallelism: the block input is already this rank's slice; every mode still matches.
    check_modes("gpt2", tensor_parallel_size=2, sequence_parallel=True)
    for schedule in ("1f1b", "zero_bubble"):
        check_pipeline(schedule)
    dist.barrier()


def test_modes_match_no_checkpointing_tp2():
    run_distributed(_tp2_worker, 2)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_(enable|disable)` is deprecated")
def test_entry_points_and_errors():
    """``ParallelConfig.activation_checkpointing`` and ``gradient_checkpointing_enable`` reach the same switch."""
    model = _build("gpt2", activation_checkpointing="selective")
    assert all(block.attn.core_checkpoint is not None and not block.gradient_checkpointing
               for block in model.transformer.h)
    enable_checkpointing(model, {"mode": "offload", "use_reentrant": False})
    assert model.activation_checkpointing_mode == "offload"
    assert all(block.attn.core_checkpoint is None and block.gradient_checkpointing for block in model.transformer.h)
    disable_checkpointing(model)
    assert model.activation_checkpointing_mode is None
    assert not any(block.gradient_checkpointing for block in model.transformer.h)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        om.ParallelConfig(activation_checkpointing="everything")
    with pytest.raises(ValueError, match="activation_checkpointing"):
        model.set_activation_checkpointing("partial")
