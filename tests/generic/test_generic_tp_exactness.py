"""Types whose ``transformers`` plan leaves a replicated parameter on a tp slice train exactly at tp 2 x dp 2 ZeRO-3.

- apertus: xIELU's ``alpha_p`` / ``alpha_n`` act on the colwise ``up_proj`` slice (no plan entry names them) and the
  per-head ``q_norm`` / ``k_norm`` on the local heads (the plan's ``replicated_with_grad_allreduce``): the generic
  path finds exactly these from the autograd graph and sums their gradients over tp.
- llama4_text: the MoE layer adds its routed experts into the shared expert's rowwise output in place, which
  autograd refuses on ``transformers``' ``to_local`` views; the generic path finds that output (version counters of a
  no-grad forward) and copies it while autograd records.

One spawned group of 4 gloo processes: each type is loaded with ``from_pretrained`` at tp 2, sharded with ZeRO-3 over
dp 2 and trained 3 AdamW steps (clipped at 0.5); every step's loss and gradient norm and every parameter after the
last step equal single-process ``transformers`` on the global batch (fp32, 1e-5). Negative controls: the same
training with the gradient sums' pre-hooks taken off the modules (what the path did before) leaves the xIELU scalars
and the norms off by more than the tolerance (and different on the two tp ranks); without the output copies Llama 4's
first training forward raises autograd's view+inplace error.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import oslo_models as om
from oslo_models import training
from oslo_models.generic.inplace_outputs import _copy_output
from oslo_models.generic.install_state import generic_install
from oslo_models.generic.partial_gradients import TensorParallelGradientSum
from tests.generic.models import auto_class, save
from tests.generic.test_generic_training import PARAM_TOL, STEPS, TOL, _train, reference
from tests.helpers.dist import breadcrumb, run_distributed

PARTIAL = {  # type: the parameters (per layer) whose gradient the plan leaves partial over tp
    "apertus": {"mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n", "self_attn.q_norm.weight", "self_attn.k_norm.weight"},
    "llama4_text": set(),
}
COPIED = {"apertus": (), "llama4_text": ("model.layers.1.feed_forward.shared_expert.down_proj",)}


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def _remove_fixes(model) -> int:
    """Take the generic path's gradient sums and output copies off the model's modules (the negative control)."""
    removed = 0
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if isinstance(hook, TensorParallelGradientSum) or hook is _copy_output:
                    del hooks[key]
                    removed += 1
    return removed


def _worker(paths, refs, reduce: bool):
    context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    for name, expected in PARTIAL.items():
        breadcrumb(f"{name}: load")
        ref_losses, ref_norms, ref_state = refs[name]
        model = auto_class(name, om).from_pretrained(paths[name], parallel=context)
        layers = model.config.num_hidden_layers
        found = generic_install(model).tp_partial_gradients
        assert set(found) == {f"model.layers.{i}.{leaf}" for i in range(layers) for leaf in expected}, found
        marked = {key for key, style in generic_install(model).tp_plan.items()
                  if style == "replicated_with_grad_allreduce"}
        assert all(any(f == key or f.startswith(key + ".") for f in found)
                   for key in marked)  # the plan's own marks are among what the graph finds
        assert generic_install(model).tp_output_copies == COPIED[name]
        if not reduce:  # act_fn, q_norm, k_norm of each layer; the copied outputs
            assert _remove_fixes(model) == 3 * layers * bool(expected) + len(COPIED[name])
        model.train()
        model, opt = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters(), lr=1e-3,
                                                                           weight_decay=0.1, eps=1e-6), zero_stage=3)
        if not reduce and COPIED[name]:
            with pytest.raises(RuntimeError, match="view and is being modified inplace"):
                _train(model, opt, context, range(1))
            del model, opt
            continue
        losses, norms = _train(model, opt, context, range(STEPS))
        state = {key: _full(value).detach() for key, value in model.state_dict().items()}
        off = {key: float((state[key] - ref_state[key]).abs().max()) for key in ref_state
               if not torch.allclose(state[key], ref_state[key], **PARAM_TOL)}
        if reduce:
            for step, (loss, norm) in enumerate(zip(losses, norms)):
                torch.testing.assert_close(loss, ref_losses[step], msg=lambda m: f"{name} loss {step}: {m}", **TOL)
                torch.testing.assert_close(norm, ref_norms[step], msg=lambda m: f"{name} norm {step}: {m}", **TOL)
            assert not off, off
        else:  # the partial parameters (and only they, first) leave the reference
            assert off and {key.split("layers.")[-1].split(".", 1)[-1] for key in off} & expected, off
            alpha = [p for n, p in model.named_parameters() if n.endswith("alpha_p")][0]
            local = _full(alpha).detach().clone()
            peers = [torch.zeros_like(local) for _ in range(context.tp_size)]
            dist.all_gather(peers, local, group=context.tp_group)
            assert not torch.equal(peers[0], peers[1])  # the tp replicas of one parameter drifted apart
        del model, opt


@pytest.mark.slow
def test_partial_gradients_summed_over_tp(tmp_path):
    paths = save(tmp_path / "models", list(PARTIAL))
    refs = {name: reference(paths[name], name) for name in PARTIAL}
    run_distributed(_worker, 4, paths, refs, True, timeout=900)
    run_distributed(_worker, 4, paths, refs, False, timeout=900)
