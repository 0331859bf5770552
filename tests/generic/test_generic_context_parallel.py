"""Context parallelism on generic causal LMs through ``transformers``' attention interface: cp 2 x dp 2 trains like
single-process transformers.

One spawned group of 4 gloo processes, through ``training.prepare`` with a plain DataLoader of whole sequences with
unequal label counts (the loader splits them into each cp rank's chunks and shifts the labels on the whole sequence;
the loss is the global batch's):

- granite, ring (ZeRO-3) and cohere2 (sliding window 4 on every other layer, tied embeddings), all-to-all (ZeRO-1);
  2025 types: exaone4 (sliding window, post-norm, QK norm; all-to-all, ZeRO-3), smollm3 (NoPE layers; ring,
  ZeRO-0), olmo3 (sliding window; ring, ZeRO-3), glm4_moe (MoE, partial rotary; all-to-all, ZeRO-3): the logged loss
  of each of 3 AdamW steps and every parameter after them equal single-process ``transformers`` (fp32, 1e-5), every
  layer attending through the registered context-parallel attention;
- negative control: the ring model fed the all-to-all split of the same rows (the chunks it holds are not where it
  puts them) trains away from the reference;
- the router's load-balancing loss (``output_router_logits=True``, coefficient 0.5) over the replica's tokens:
  ernie4_5_moe (ring) and minimax_m2 (all-to-all) at cp 2 x dp 2 ZeRO-3: the logged losses of 3 AdamW steps and
  every parameter equal single-process ``transformers`` on each step's replicas (the global batch's token loss plus
  each replica's own router term, as data parallelism alone and the native families keep it; 1e-5); negative
  control: with the hook taken off (each cp rank's router term from its chunk, without the padding mask) the logged
  losses are off;
- refused with the reason at load: the hybrids qwen3_next (gated DeltaNet), granitemoehybrid (Mamba-2) and lfm2_moe
  (short convolution), whose first layer does not attend through the interface.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.data.collators.context_parallel import ContextParallelSplitter
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

CASES = {"granite": ("ring", 3), "cohere2": ("all_to_all", 1), "exaone4": ("all_to_all", 3), "smollm3": ("ring", 0),
         "olmo3": ("ring", 3), "glm4_moe": ("all_to_all", 3), "vaultgemma": ("ring", 0),  # soft-capping
         "granite_swa": ("all_to_all", 0)}  # sinks. name: (context_parallel_mode, zero stage)
HYBRIDS = ("qwen3_next", "granitemoehybrid", "lfm2_moe")
BATCH = 4


class _SplitAs:
    """A collate function splitting with a given splitter (``training.prepare`` then leaves the batch as it is)."""

    def __init__(self, splitter):
        self.splitter = splitter

    def __call__(self, rows):
        return self.splitter(_collate(rows))


def _load(path, mode):
    parallel = om.ParallelConfig(context_parallel_size=2, data_parallel_size=2, context_parallel_mode=mode)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()


ROUTER_LOSS = {"ernie4_5_moe": "ring", "minimax_m2": "all_to_all"}
# a coefficient that makes the router term count (at the types' 0.001 default, embedding rows reached by no label
# get gradients near float noise, which AdamW's normalized step amplifies: their comparison would test rounding)
ROUTER = dict(output_router_logits=True, router_aux_loss_coef=0.5)


def _replica_reference_steps(reference, rows: list[dict], dp: int) -> tuple[torch.nn.Module, list[float]]:
    """Single-process ``transformers`` on each step's replicas (the rows ``training.prepare``'s loader gives dp rank
    ``d``): the global batch's token loss plus each replica's own router term (``tests/helpers/global_loss.py``)."""
    from tests.helpers.global_loss import part_reference_steps

    return part_reference_steps(reference, rows, dp, BATCH, _collate)


def _router_loss_case(path, mode, rows, replica_term: bool):
    """3 steps with the load-balancing loss on; ``replica_term=False`` takes the hook off. Returns whether the
    logged losses and parameters equal the reference's."""
    import transformers

    from oslo_models.generic.router_loss import ReplicaRouterLoss

    parallel = om.ParallelConfig(context_parallel_size=2, data_parallel_size=2, context_parallel_mode=mode)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, **ROUTER).train()
    if not replica_term:
        for key, hook in list(model._forward_hooks.items()):
            if isinstance(hook, ReplicaRouterLoss):
                del model._forward_hooks[key]
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, **ROUTER).train()
    reference, expected = _replica_reference_steps(reference, rows, model.parallel_context.dp_size)
    if not torch.allclose(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5):
        return False
    assert_same_parameters(model, reference)
    return True


def _worker(paths):
    import transformers

    rows = sft_rows(101, 48)
    for name, (mode, stage) in CASES.items():
        breadcrumb(name)
        model = _load(paths[name], mode)
        assert model.config._attn_implementation == "oslo_context_parallel"
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=stage)
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                              BATCH * model.parallel_context.dp_size)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {mode} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model
    breadcrumb("negative control")
    model = _load(paths["granite"], "ring")
    context = model.parallel_context
    wrong = _SplitAs(ContextParallelSplitter(context, mode="all_to_all"))
    model, _ = prepared_steps(model, rows, batch=BATCH, zero_stage=3, collate_fn=wrong)
    assert parameters_differ(model, reference_steps(transformers.GraniteForCausalLM.from_pretrained(
        paths["granite"]).train(), rows, BATCH * context.dp_size)[0])
    for name, mode in ROUTER_LOSS.items():
        breadcrumb(f"{name}: router loss over the replica ({mode})")
        assert _router_loss_case(paths[name], mode, rows, True), name
    breadcrumb("negative control: the chunk's router loss")
    assert not _router_loss_case(paths["ernie4_5_moe"], "ring", rows, False)
    for name in HYBRIDS:
        with pytest.raises(NotImplementedError, match=r"1 of the 2 layers of \w+ForCausalLM attend through"):
            _load(paths[name], "ring")


@pytest.mark.slow
def test_generic_context_parallel(tmp_path):
    paths = save(tmp_path / "models", (*CASES, *HYBRIDS, *ROUTER_LOSS))
    run_distributed(_worker, 4, paths, timeout=900)
