"""cp x ep x pp for the native MoE families (a refusal lifted, issue 52): the pipeline runner sums the expert
gradients over edp and divides them by dp x cp (``pipeline/runner.py``, as the unpipelined path does), so experts
carved out of dp x cp train under a pipeline too.

The pipelined load-balancing loss under cp (``models/mixtral/pipeline_mixtral.py``) sums the routing statistics over
cp before the product and adds ``1/cp`` of the term on each cp rank (the runner sums the cp ranks' losses): before,
each chunk's own term was summed over cp, so pp x cp counted the router loss ``cp`` times (Mixtral at pp2 x cp2, with
or without ep: loss 5.309 against ``transformers``' 4.706 at the first step; seen, now equal).

One spawned world of 4 gloo processes, pp 2 x cp 2 x ep 2 (dp 1: the ep group is the cp pair of each stage), GPipe
with one microbatch (the pipelined router term is the mean of the microbatches' terms: with one it is
``transformers``' on the batch) through ``model.train_step`` on the splitter's chunks: 3 AdamW steps give the loss
(token loss + router term, ``output_router_logits=True`` in the tiny records), every local gradient and every local
parameter of single-process ``transformers`` (fp32, 1e-5; ``assert_pipeline_matches``) on right-padded rows of
unequal label counts, for Mixtral (ring and all-to-all) and Qwen2-MoE (ring, shared expert). Negative control: the
experts' gradients scaled as before the lift (divided by dp, not dp x cp: twice the reference's) fail the gradient
comparison. The generic path shares the runner: dots1 (``transformers``' own class, DeepSeek's grouped sigmoid
router, no router loss; the generic path refuses the router loss under pp x cp) at pp 2 x cp 2 x ep 2, 1F1B with 2
microbatches through ``training.prepare``: the logged loss of 3 AdamW steps and every parameter equal
``transformers`` on SFT rows of unequal label counts (1e-5).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from oslo_models.utils.model_protocol import protocol_of
from tests.helpers.decoders import save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.pipeline import assert_pipeline_matches


def _setup(path: str, mode: str, partition="uniform"):
    cfg = om.ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2, context_parallel_mode=mode,
                            expert_parallel_size=2, num_microbatches=1, pipeline_schedule="gpipe",
                            pipeline_partition=partition)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    context = model.parallel_context
    assert (context.pp_size, context.cp_size, context.ep_size, context.dp_size) == (2, 2, 2, 1)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    ids, mask, labels = padded_batch(reference.config.vocab_size, batch=4, seq=16)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    return model, reference, batch, ContextParallelSplitter(context)(batch)


def _generic_dots1(path: str) -> None:
    from tests.training.test_global_batch_loss import (
        assert_same_parameters,
        prepared_steps,
        reference_steps,
        sft_rows,
    )

    cfg = om.ParallelConfig(pipeline_parallel_size=2, num_microbatches=2, context_parallel_size=2,
                            expert_parallel_size=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg).train()
    assert not hasattr(model, "parallel_plan")  # the generic path
    rows = sft_rows(101, 48)
    model, logged = prepared_steps(model, rows, batch=4, zero_stage=0)
    reference, expected = reference_steps(transformers.AutoModelForCausalLM.from_pretrained(path).train(), rows, 4)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert_same_parameters(model, reference)


def _worker(paths: dict) -> None:
    for family, mode, partition in (("mixtral", "ring", "uniform"), ("mixtral", "all_to_all", "uniform"),
                                    ("qwen2_moe", "ring", (2, 1))):  # Qwen2-MoE's tiny record: 3 layers
        breadcrumb(f"{family} {mode}")
        model, reference, batch, local = _setup(paths[family], mode, partition)
        assert_pipeline_matches(model, reference, batch, local=local, steps=3)
    breadcrumb("negative control")
    model, reference, batch, local = _setup(paths["mixtral"], "ring")
    reference(**batch).loss.backward()
    model.train_step(local)
    experts = [p for unit in protocol_of(model).expert_units(model) for p in unit.parameters(recurse=False)]
    assert experts, "no expert parameters on this stage"
    for param in experts:  # what dividing by dp only gave: cp x the mean
        param.grad.mul_(model.parallel_context.cp_size)
    with pytest.raises(AssertionError):
        assert_grads_match(model, reference)
    breadcrumb("generic dots1")
    _generic_dots1(paths["dots1"])


def test_pp2_x_cp2_x_ep2_matches_transformers(tmp_path):
    from tests.generic.models import save

    paths = {family: save_tiny(tmp_path / family, family) for family in ("mixtral", "qwen2_moe")}
    paths.update(save(tmp_path / "generic", ["dots1"]))
    run_distributed(_worker, 4, paths, timeout=900)
