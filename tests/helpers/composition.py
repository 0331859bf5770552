"""Train one layout of the composition table (``oslo_models/composition``) against single-process ``transformers``.

``train_layout(layout, model_class, path)`` runs on every rank of a world of ``layout.world_size`` processes (or in
the test process for one): the model is built from ``path`` at ``layout``'s ``ParallelConfig`` (pp, tp/sp/grid, cp,
ep, activation checkpointing), compiled when the layout says so (``torch.compile``, ``aot_eager``: the graph is
captured through the parallel layers, without a C++ toolchain), then wrapped by ``om.training.prepare`` (dp,
ZeRO 1-3, offload; Accelerate's bf16 autocast). The reference is the ``transformers`` twin from the same folder,
trained on the loss of the global batch (``tests/helpers/global_loss.py``: the replicas' padded rows hold different
label counts; the MoE decoders' router loss is per replica). Every step compares the loss; after the steps, every
local parameter.

Precision: fp32 layouts match at 1e-5. bf16 layouts run the reference under the same autocast and match within bf16
rounding of partial sums reduced in another order; the low-precision mixture-of-experts layouts route every token
where the reference routed it and leave out the load-balancing loss (``tests/helpers/forced_routing.py``: a top-k
tie at rounding level is a discrete decision no tolerance bounds; the fp32 layouts compare the routing and that
loss). fp16: Accelerate creates no loss scaler on a CPU and refuses fp16 there (``training.check_mixed_precision``),
so the fp16 cells run ``torch.autocast("cpu", float16)`` with a ``GradScaler("cpu")`` around the step and
``training.sync_overflow`` keeping the ranks' skip decisions together, the reference with its own scaler: the same
pieces a GPU run uses, without Accelerate's wrapper. Pipelined, the scaler goes to ``train_step`` (each microbatch's
loss is scaled inside the schedule) and the autocast around it reaches the stages.
"""
from __future__ import annotations

import contextlib

import torch

from oslo_models import training
from oslo_models.composition import Layout
from tests.helpers.forced_routing import ForcedRouting
from tests.helpers.global_loss import replica_loss, replica_weights, with_global_share
from tests.helpers.layouts import local_batch
from tests.helpers.models import assert_params_match, padded_batch
from tests.helpers.pipeline import ADAMW, local_rows

STEPS = 5
TOLERANCE = {"no": dict(atol=1e-5, rtol=1e-5), "bf16": dict(atol=2e-2, rtol=2e-2),
             "fp16": dict(atol=2e-3, rtol=2e-3)}
# Low precision, parameters: AdamW (lr 1e-3, eps 1e-5) moves an element whose gradient is at the dtype's rounding
# level by ~lr per step whatever that gradient's size, so the two sides' reduction orders can turn one element's step
# the other way: up to 2 x lr apart (seen: fp16 at tp2+sp x dp2 x ZeRO-1 x compile, 1 of 3264 embedding elements
# 1.05e-3 apart after 3 steps; with the global batch's token weighting, cp2 x dp2 x ZeRO-3+offload x bf16 x compile,
# 1 of 6464 embedding elements 2.03e-3 apart after 5: a flip plus the momentum it leaves). A missing or doubled
# gradient moves whole tensors by more.
PARAM_TOLERANCE = {"no": dict(atol=1e-5, rtol=1e-4), "bf16": dict(atol=3e-3, rtol=0), "fp16": dict(atol=3e-3, rtol=0)}


def _is_moe(config) -> bool:
    return bool(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))


def _autocast(precision: str):
    if precision == "no":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _accelerator(layout: Layout):
    from accelerate.state import AcceleratorState

    from accelerate import Accelerator

    # Accelerate keeps one state per process; the layouts of one group differ in mixed precision
    AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(cpu=True, mixed_precision="bf16" if layout.mixed_precision == "bf16" else "no")


def build(layout: Layout, model_class, path: str):
    """The parallel model at ``layout`` (steps 1-6 of ``composition.APPLY_ORDER``) and its twin reference."""
    parallel = layout.parallel_config()
    if layout.moe and parallel.pipeline_parallel_size > 1:
        # the router loss is per microbatch in a pipeline and per batch in the reference: one microbatch
        import dataclasses

        parallel = dataclasses.replace(parallel, pipeline_schedule="gpipe", num_microbatches=1)
    if parallel.offload == "nvme":  # a fresh scratch folder per run: concurrent runs must not share one
        import dataclasses
        import tempfile

        parallel = dataclasses.replace(parallel, offload_path=tempfile.mkdtemp(prefix="oslo_nvme_"))
    model = model_class.from_pretrained(path, parallel=parallel, progress=False).train()
    reference = model_class.hf_twin.from_pretrained(path).train()
    return model, reference


def _batch(config, moe_pipeline: bool) -> dict:
    ids, mask, labels = padded_batch(config.vocab_size, batch=4, seq=16)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if moe_pipeline:  # the router loss is per replica: both replicas get the same rows
        batch = {key: torch.cat([value[:2], value[:2]]) for key, value in batch.items()}
    return batch


def train_layout(layout: Layout, model_class, path: str, steps: int = STEPS) -> None:
    model, reference = build(layout, model_class, path)
    context = model.parallel_context
    precision = layout.mixed_precision
    # low-precision MoE: the reference's routing decisions forced onto the model (tests/helpers/forced_routing.py)
    forced = ForcedRouting(model, reference) if layout.moe and precision != "no" else None
    # ... and no load-balancing loss: transformers' takes its own top-k of the logits, which would flip at the same
    # ties (a flip moves an expert's assignment fraction by 1/(tokens*k), several % of the router's gradient here)
    options = dict(output_router_logits=False) if forced is not None else {}
    if forced is not None and model.parallel_context.pp_size > 1:
        raise ValueError("low-precision MoE layouts under a pipeline: train_step keeps the load-balancing loss")
    tol, param_tol = TOLERANCE[precision], PARAM_TOLERANCE[precision]
    if layout.compile:
        model = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    model, optimizer = training.prepare(_accelerator(layout), model, optimizer, zero_stage=layout.zero_stage,
                                        cpu_offload=layout.cpu_offload)
    inner = training.unwrap_model(model)
    inner = getattr(inner, "_orig_mod", inner)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)] if precision == "fp16" else None
    pipelined = context.pp_size > 1
    batch = _batch(reference.config, layout.moe and pipelined)
    if pipelined:  # train_step takes this replica's rows (consecutive chunks) and returns the replicas' mean loss
        replicas = [{k: v.chunk(context.dp_size)[d] for k, v in batch.items()} for d in range(context.dp_size)]
        local, mine = local_batch(context, local_rows(context, batch), shift_labels=True), None  # cp: chunks
    else:
        replicas = [{k: v[d::context.dp_size].contiguous() for k, v in batch.items()} for d in range(context.dp_size)]
        local, mine = local_batch(context, replicas[context.dp_rank], shift_labels=True), context.dp_rank
    if not pipelined:  # what training.prepare's loader attaches (train_step counts the labels itself)
        local = with_global_share(inner, local, shift=True)
    weights = replica_weights(replicas, shift=True, model=inner)
    for step in range(steps):
        if forced is not None:
            forced.begin_step()
        with _autocast(precision):
            losses = [replica_loss(reference(**replica, **options), replica, weight, shift=True)
                      for replica, weight in zip(replicas, weights)]
            # pipelined fp16: the schedule scales each microbatch's loss with the model's scaler (runner.py)
            got = (model.train_step(local, scaler=scalers and scalers[1]) if pipelined
                   else model(**local, **options).loss)
        # pipelined: the mean over replicas; else this replica's rows' (data parallelism averages the gradients)
        expected = sum(losses) / len(losses) if mine is None else losses[mine]
        torch.testing.assert_close(got.detach().float(), expected.detach().float(), **tol,
                                   msg=lambda m, s=step: f"step {s}: {m}")
        _step(scalers, sum(losses) / len(losses), None if pipelined else got, optimizer, ref_optimizer, context)
    assert_params_match(inner, reference, **param_tol)
    if forced is not None:
        forced.remove()
    close = getattr(training.unwrap_optimizer(optimizer), "close", None)  # the NVMe tier's scratch file and lock
    if close is not None:
        close()


def _step(scalers, expected, got, optimizer, ref_optimizer, context) -> None:
    if scalers is None:
        expected.backward()
        if got is not None:
            got.backward()
        ref_optimizer.step(), optimizer.step()
    else:
        ref_scaler, scaler = scalers
        ref_scaler.scale(expected).backward()
        if got is not None:
            scaler.scale(got).backward()
        ref_scaler.unscale_(ref_optimizer), scaler.unscale_(optimizer)
        training.sync_overflow(scaler, context)
        ref_scaler.step(ref_optimizer), scaler.step(optimizer)
        ref_scaler.update(), scaler.update()
    ref_optimizer.zero_grad(), optimizer.zero_grad()
