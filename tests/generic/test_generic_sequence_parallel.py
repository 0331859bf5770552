"""Sequence parallelism on generic decoders, from the type's plan: tp 2 + SP x dp 2 ZeRO-3 trains like transformers.

One spawned group of 4 gloo processes, through ``training.prepare`` with a plain DataLoader of rows with unequal
label counts (the loss is the global batch's):

- granite (dense decoder, untied vocabulary-parallel head), apertus (xIELU scalars and q/k norms inside the
  regions), exaone4 (post-norm layers, per-head QK norm, a sliding-window layer), smollm3 (NoPE layers, tied head),
  glm4_moe and ernie4_5_moe (MoE regions: the router reads the gathered sequence as a plain tensor, the experts'
  all-reduced output is cut to the rank's slice): the logged loss of each of 3 AdamW steps and every parameter after
  them equal single-process ``transformers`` (fp32, 1e-5);
- between the tensor-parallel regions each rank holds half of the sequence (a decoder layer's output is
  ``[b, s/2, h]``), and the layer norms' weights are among the parameters whose gradient is summed over tp;
- negative control (granite, apertus): the same training with the gradient sums taken off (each tp rank steps its
  norms on its half of the tokens) leaves the norms' weights off the reference;
- refused with the reason: olmoe and olmo3, whose attention the plan gathers whole (no colwise region to split
  around), granitemoehybrid (its plan names only the experts: the shared MLP and the Mamba-2 mixer are outside it)
  and lfm2_moe (a short-convolution mixer); olmo3, granitemoehybrid and lfm2_moe then train at tp 2 x dp 2 ZeRO-3
  without SP like ``transformers`` (1e-5).
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.generic.install_state import generic_install
from tests.generic.models import save
from tests.generic.test_generic_tp_exactness import _remove_fixes
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import tp_local
from tests.training.test_global_batch_loss import assert_same_parameters, prepared_steps, reference_steps, sft_rows

CASES = ("granite", "apertus", "exaone4", "smollm3", "glm4_moe", "ernie4_5_moe")
NEGATIVE = ("granite", "apertus")
BATCH, SEQ = 4, 16
NORMS = {"granite": ("input_layernorm", "post_attention_layernorm"),
         "apertus": ("attention_layernorm", "feedforward_layernorm"),
         "exaone4": ("post_attention_layernorm", "post_feedforward_layernorm"),
         "smollm3": ("input_layernorm", "post_attention_layernorm"),
         "glm4_moe": ("input_layernorm", "post_attention_layernorm"),
         "ernie4_5_moe": ("input_layernorm", "post_attention_layernorm")}
REFUSED = {  # type: what sequence parallelism cannot split (then trained at tp 2 without it)
    "olmoe": "self_attn .*OlmoeAttention.* no colwise entries",
    "olmo3": "self_attn .*Olmo3Attention.* no colwise entries",
    "granitemoehybrid": "shared_mlp .*GraniteMoeHybridMLP.* no colwise entries",
    "lfm2_moe": "conv .*Lfm2MoeShortConv.* no colwise entries",
}
WITHOUT_SP = ("olmo3", "granitemoehybrid", "lfm2_moe")


def _train_and_compare(path, parallel, rows):
    """3 steps through ``training.prepare`` at ZeRO-3 and the comparison with ``transformers``; returns the model."""
    import transformers

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()
    dp = model.parallel_context.dp_size
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3)
    reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
    reference, expected = reference_steps(reference_class.from_pretrained(path).train(), rows, BATCH * dp)
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{path} logged losses: {m}")
    assert_same_parameters(model, reference)


def _worker(paths, fixed: bool):
    import transformers

    parallel = om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, sequence_parallel=True)
    for name in CASES if fixed else NEGATIVE:
        breadcrumb(name)
        model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel).train()
        context = model.parallel_context
        norms = {n for n in generic_install(model).tp_partial_gradients if n.split(".")[-2] in NORMS[name]}
        assert len(norms) == 2 * model.config.num_hidden_layers, generic_install(model).tp_partial_gradients
        shapes = []
        model.model.layers[0].register_forward_hook(lambda module, args, output: shapes.append(tuple(output.shape)))
        if not fixed:
            _remove_fixes(model)
        rows = sft_rows(101, 48)
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=3)
        assert shapes[0] == (BATCH, SEQ // context.tp_size, model.config.hidden_size), shapes[0]
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows,
                                              BATCH * context.dp_size)
        if fixed:
            torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"{name} logged losses: {m}")
            assert_same_parameters(model, reference)
        else:  # the norms' weights, stepped on half of the tokens' gradient, leave the reference
            expected_params = dict(reference.named_parameters())
            off = [n for n in norms if not torch.allclose(tp_local(dict(model.named_parameters())[n].detach()),
                                                          expected_params[n].detach(), atol=1e-4)]
            assert off, "the norms matched without their gradient sums"
        del model, reference
    if fixed:
        for name, match in REFUSED.items():
            breadcrumb(f"{name}: refused")
            with pytest.raises(NotImplementedError, match=match):
                om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel)
        without = om.ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
        for name in WITHOUT_SP:
            breadcrumb(f"{name}: tp 2 without SP")
            _train_and_compare(paths[name], without, sft_rows(101, 48))


@pytest.mark.slow
def test_generic_sequence_parallel(tmp_path):
    paths = save(tmp_path / "models", (*CASES, *REFUSED))
    run_distributed(_worker, 4, paths, True, timeout=900)
    run_distributed(_worker, 4, paths, False, timeout=900)
