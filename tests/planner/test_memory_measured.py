"""The planner's training-state model against what ranks really hold: for several layouts of a tiny Llama (4
layers, 2 key/value heads, biases) in ONE spawned world of 4 gloo processes, the predicted parameter, gradient and
AdamW-state bytes of every rank equal, byte for byte, the local tensors the rank holds after one optimizer step
(DTensor shards counted by their local piece; ZeRO-1's state on the owning rank only).

Layouts: tp4 (key/value heads replicated), dp4 ZeRO-1 (torch's greedy partition), tp2 x dp2
ZeRO-3, dp4 HSDP (shards of 2) ZeRO-2, pp2 x dp2 ZeRO-2 (1f1b), cp2 x dp2 ZeRO-3 + CPU offload, tp2 x dp2 ZeRO-1
(ZeRO-1's partition of tensor-parallel shards) and pp2 x tp2 (8 layouts).

In the same world, the activation model (``planner.memory.activation_bytes``) against the bytes the saved-tensor
hooks see in one forward, within 10% on every rank, at tp2, tp2 + sp, tp2 + sp + full checkpointing, cp2 and
tp2 x sp x cp2 (hidden 128). Not measured here: pipeline ranks' in-flight microbatches (a schedule's peak).
"""
from __future__ import annotations

import torch

import oslo_models as om
from accelerate import Accelerator
from oslo_models import training
from oslo_models.planner.facts import ModelFacts
from oslo_models.planner.measured import saved_activation_bytes, state_bytes
from oslo_models.planner.memory import activation_bytes, training_state
from tests.helpers.decoders import tiny_config
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import local_batch

LAYOUTS = (
    (dict(tensor_parallel_size=4), False),
    (dict(data_parallel_size=4, zero_stage=1), False),
    (dict(tensor_parallel_size=2, data_parallel_size=2, zero_stage=3), False),
    (dict(data_parallel_size=4, data_parallel_shard_size=2, zero_stage=2), False),
    (dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2, zero_stage=2), False),
    (dict(context_parallel_size=2, data_parallel_size=2, zero_stage=3), True),
    (dict(tensor_parallel_size=2, data_parallel_size=2, zero_stage=1), False),
    (dict(pipeline_parallel_size=2, tensor_parallel_size=2, num_microbatches=2), False),
)


def _measured_world() -> None:
    config = tiny_config("llama", num_hidden_layers=4)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    ids = torch.randint(1, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    for options, offload in LAYOUTS:
        breadcrumb(str(options))
        parallel = om.ParallelConfig(**options)
        torch.manual_seed(0)
        model = om.LlamaForCausalLM.from_config(config, parallel=parallel)
        context = model.parallel_context
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if parallel.zero_stage or offload:
            model, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer,
                                                zero_stage=parallel.zero_stage, cpu_offload=offload)
        else:
            model, optimizer = training.shard_data_parallel(model, optimizer)
        inner = training.unwrap_model(model)
        if context.pp_size > 1:
            inner.train_step({"input_ids": ids, "labels": ids})
        else:
            rows = ids[context.dp_rank::context.dp_size]
            model(**local_batch(context, {"input_ids": rows, "labels": rows}, True)).loss.backward()
        optimizer.step()
        got = state_bytes(inner, optimizer)
        state = training_state(facts, parallel, 4, pp_rank=context.pp_rank, dp_rank=context.dp_rank,
                               cp_rank=context.cp_rank)
        predicted = (state.parameters, state.gradients, state.optimizer)
        assert predicted == got, f"{options}: predicted {predicted} != measured {got} on rank {context.rank}"
    check_activations()


def test_training_state_bytes_equal_measured():
    """... and, in the same world, the activation model within 10% of the saved-tensor hooks (``check_activations``)."""
    run_distributed(_measured_world, 4, timeout=600)


# activations, measured in the same world: tensor parallelism with and without sequence parallelism (and full
# checkpointing on top), context parallelism (ring), and tp x sp x cp
ACTIVATION_LAYOUTS = (dict(tensor_parallel_size=2), dict(tensor_parallel_size=2, sequence_parallel=True),
                      dict(tensor_parallel_size=2, sequence_parallel=True, activation_checkpointing="full"),
                      dict(context_parallel_size=2),
                      dict(tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2))


def check_activations() -> None:
    """The activation model against the saved-tensor hooks (one forward) for ``ACTIVATION_LAYOUTS`` in the world of
    4 (dp 2, or tp2 x cp2), every rank; hidden 128, intermediate 352, 4 layers, 2 x 48 tokens per replica."""
    config = tiny_config("llama", num_hidden_layers=4, hidden_size=128, intermediate_size=352)
    facts = ModelFacts(om.LlamaForCausalLM, config)
    ids = torch.randint(1, config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    for options in ACTIVATION_LAYOUTS:
        breadcrumb(f"activations {options}")
        parallel = om.ParallelConfig(**options)
        torch.manual_seed(0)
        model = om.LlamaForCausalLM.from_config(config, parallel=parallel)
        context = model.parallel_context
        rows = ids[context.dp_rank::context.dp_size]
        got = saved_activation_bytes(model, local_batch(context, {"input_ids": rows, "labels": rows}, True))
        predicted = activation_bytes(facts, parallel, micro_batch=rows.shape[0], seq_len=48, num_microbatches=1)
        assert abs(predicted - got) <= 0.1 * got, f"{options}: predicted {predicted}, saved {got}"
