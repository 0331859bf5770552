"""Pipeline x expert parallelism at ZeRO-1, 2 and 3 with the other axes, on 8 gloo processes (one spawned group;
issue 50): the layouts ``test_pipeline_expert_zero.py`` (pp 2 x ep 2 in dp 2) cannot reach on 4.

- glm4_moe (generic: a dense first layer, then MoE with shared experts inside the plan's regions) at
  tp 2 + SP x pp 2 x cp 2 (ring) x ep 2 at ZeRO-3, ep carved out of cp (dp 1): the issue's whole example at ZeRO-3 -
  each stage an FSDP2 root over its dense blocks, the experts their own units on the edp mesh;
- native Mixtral at pp 2 x ep 2 x tp 2 in dp 2, ZeRO-3: the tensor-parallel experts-and-attention stages with the
  expert units on the edp mesh;
- dp 4 with ep 2 under pp 2 (edp 2: two ranks hold the same experts, so their gradients are really summed over edp
  and the ZeRO-1 partition of the experts' state spans two ranks): the generic dots1 at ZeRO-2 (FSDP2 units of the
  experts on an edp mesh of size 2) and native Mixtral at ZeRO-1 (``split_optimizer``: experts' state over edp);
- each through ``training.prepare`` and ``model.train_step`` (1F1B, two microbatches per replica) with a plain
  DataLoader of SFT rows whose label counts differ: the logged loss of each of 3 AdamW steps and every parameter
  after them equal single-process ``transformers`` on the global batch (fp32, 1e-5);
- negative controls (both train away): Mixtral at tp 2 ZeRO-3 with its experts left in their layer's FSDP2 unit on
  the dp mesh (reduced with ranks holding other experts), and Mixtral at dp 4 ZeRO-1 with the experts averaged over
  dp like dense weights (the runner's expert rule off).
"""
from __future__ import annotations

import pytest

from tests.helpers.dist import run_distributed
from tests.pipeline.test_pipeline_expert_zero import check, save_models

PP_EP = dict(pipeline_parallel_size=2, num_microbatches=2, expert_parallel_size=2)
FIVE_AXES = dict(PP_EP, tensor_parallel_size=2, sequence_parallel=True, context_parallel_size=2)
TP = dict(PP_EP, tensor_parallel_size=2, data_parallel_size=2)
EDP2 = dict(PP_EP, data_parallel_size=4)
CASES = [("glm4_moe", 3, FIVE_AXES), ("mixtral", 3, TP), ("dots1", 2, EDP2), ("mixtral", 1, EDP2)]
CONTROLS = [("mixtral", 3, "plan", TP), ("mixtral", 1, "runner", EDP2)]


def _worker(paths):
    check(paths, CASES, CONTROLS)


@pytest.mark.slow
def test_pipeline_expert_parallel_zero_on_eight_ranks(tmp_path):
    run_distributed(_worker, 8, save_models(tmp_path, generic=("dots1", "glm4_moe")), timeout=1500)
