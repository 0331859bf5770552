"""Pipelined generic models with the training options (issue 50): CPU offload, NVMe, LoRA, activation checkpointing
and compiled layers at pp x ep and pp x cp.

One spawned group of 4 gloo processes; dots1 (a dense first layer, then MoE) at pp 2 x ep 2 in dp 2 and granite at
pp 2 x cp 2 (ring), 1F1B with two microbatches per replica, through ``training.prepare`` and ``model.train_step`` with
a plain DataLoader of SFT rows whose label counts differ:

- pp x ep: ZeRO-3 with CPU offload (FSDP2 offload of each stage's units, experts on the edp mesh); ZeRO-2 with
  ``offload="nvme"`` (the Adam state on disk; the experts' share read from the model protocol's expert units: before,
  the space check read a native ``parallel_plan`` and failed on every generic model with experts); LoRA
  (``adapters.load_adapter`` of a plain ``peft`` adapter on the attention) at ZeRO-0 and at ZeRO-3 asked of
  ``prepare`` (the layout check now reads the model inside the peft wrapper: it refused ``PeftModel`` as "not a causal
  LM"); ``activation_checkpointing="full"`` at ZeRO-1; the stage's decoder layers compiled (``layer.compile``,
  ``aot_eager``) at ZeRO-0;
- pp x cp: ``activation_checkpointing="full"`` and compiled layers, ZeRO-0;
- each: the logged loss of each of 3 AdamW steps and every parameter (LoRA: every adapter) after them equal
  single-process ``transformers`` (``peft``) on the global batch (fp32, 1e-5);
- refused before any collective: peft adapters on the experts split over ep (``training.prepare`` raises
  ``NotImplementedError`` with the reason on every rank; before, the stage holding them failed inside the schedule
  with a DTensor/Tensor mix and the other stage hung);
- negative controls: an NVMe run (ZeRO-0, where the runner reduces the experts' gradients) with the runner's expert
  rule off (the experts averaged over dp like dense weights) trains away; the LoRA adapters moved from their loaded
  values; the compiled runs captured graphs;
- refused before any collective: ``torch.compile(model)`` of the whole pipelined model (``train_step`` runs the
  stages through the schedule, outside the compiled ``forward``, so it would compile nothing; the reason says to
  compile the layers); negative control: with the refusal off it trains but captures no graph.
"""
from __future__ import annotations

import os

import pytest
import torch

import oslo_models as om
from oslo_models import adapters
from tests.generic.models import save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.training.test_global_batch_loss import (
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

peft = pytest.importorskip("peft")

BATCH = 4  # rows per replica and step: 2 microbatches of 2
PP = dict(pipeline_parallel_size=2, num_microbatches=2)
EP = dict(PP, data_parallel_size=2, expert_parallel_size=2)
CP = dict(PP, context_parallel_size=2)
# (name, layout, ZeRO stage, option): option one of offload / nvme / lora / ac / compile
CASES = [("dots1", EP, 3, "offload"), ("dots1", EP, 2, "nvme"), ("dots1", EP, 0, "lora"), ("dots1", EP, 3, "lora"),
         ("dots1", EP, 1, "ac"), ("dots1", EP, 0, "compile"), ("granite", CP, 0, "ac"), ("granite", CP, 0, "compile")]


def _without_compile_rule():
    """``training.prepare`` without its refusal of a compiled pipelined model (the negative control)."""
    import importlib
    from unittest import mock

    from oslo_models.training import layout_rules

    # the modules (oslo_models.training exports the function prepare under the module's name)
    prepare, zero = (importlib.import_module(f"oslo_models.training.{name}") for name in ("prepare", "zero"))

    def check(*args, **kwargs):
        return layout_rules.check_training_layout(*args, **{**kwargs, "compiled": False})

    return (mock.patch.multiple(prepare, check_training_layout=check),
            mock.patch.multiple(zero, check_training_layout=check))


def _compile_layers(model) -> int:
    """Compile each decoder layer this rank holds in place (the others are parameter-free probes); their count."""
    held = [layer for layer in model.model.layers if next(layer.parameters(), None) is not None]
    for layer in held:
        layer.compile(backend="aot_eager")
    return len(held)


def _train(paths, root, name, layout, zero_stage, option, rows, broken=False):
    import torch._dynamo
    import transformers

    extra = dict(activation_checkpointing="full") if option == "ac" else {}
    if option == "nvme":
        extra = dict(offload="nvme", offload_path=os.path.join(root, f"nvme_{name}_{zero_stage}_{broken}"))
    model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=om.ParallelConfig(**layout, **extra)).train()
    reference = transformers.AutoModelForCausalLM.from_pretrained(paths[name]).train()
    dp = model.parallel_context.dp_size
    if option == "ac":  # transformers >= 5.23 names it is_activation_checkpointing (5.17: the old name only)
        assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    if broken:  # the experts' gradients averaged over dp like dense weights
        model._pipeline_runner()._expert_parameters = dict
    if option == "compile":
        assert _compile_layers(model) == 1
        torch._dynamo.utils.counters.clear()
    if option == "lora":
        model = adapters.load_adapter(model, paths["adapter"], is_trainable=True)
        reference = peft.PeftModel.from_pretrained(reference, paths["adapter"], is_trainable=True).train()
        loaded = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        assert loaded
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage,
                                   cpu_offload=option == "offload")
    if option == "compile":
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "nothing compiled"
    if option == "lora":  # negative control: this stage's adapters were trained
        for key, value in loaded.items():
            trained = dict(model.named_parameters())[key].detach()
            trained = trained.full_tensor() if hasattr(trained, "full_tensor") else trained
            assert (trained - value).abs().max() > 1e-4, key
    reference, expected = reference_steps(reference, rows, BATCH * dp)
    if option == "lora":  # the adapted models (the same names: q_proj.base_layer.weight, q_proj.lora_A...)
        model, reference = model.get_base_model(), reference.get_base_model()
    return model, reference, logged, expected


def _worker(paths, root):
    import torch._dynamo
    import torch.distributed as dist

    rows = sft_rows(101, 48)
    for name, layout, zero_stage, option in CASES:
        breadcrumb(f"{name} {layout} zero{zero_stage} {option}")
        model, reference, logged, expected = _train(paths, root, name, layout, zero_stage, option, rows)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} {option} zero{zero_stage} logged losses: {m}")
        assert_same_parameters(model, reference)
        del model, reference
    breadcrumb("negative control: nvme with the experts averaged over dp")
    model, reference, _, _ = _train(paths, root, "dots1", EP, 0, "nvme", rows, broken=True)
    differ = torch.tensor(float(parameters_differ(model, reference)))
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)  # the experts live on the last stage only (layer 0 is dense)
    assert differ.item(), "the broken nvme run matched transformers"
    del model, reference

    breadcrumb("torch.compile of the whole pipelined model compiles nothing: refused")
    model = om.AutoModelForCausalLM.from_pretrained(paths["granite"], parallel=om.ParallelConfig(**CP)).train()
    with pytest.raises(ValueError, match="torch.compile of a whole model with pipeline_parallel_size > 1"):
        prepared_steps(torch.compile(model, backend="aot_eager"), rows, batch=BATCH)
    del model
    breadcrumb("negative control: with the refusal off, the whole-model compile captures no graph")
    model = om.AutoModelForCausalLM.from_pretrained(paths["granite"], parallel=om.ParallelConfig(**CP)).train()
    torch._dynamo.utils.counters.clear()
    in_prepare, in_zero = _without_compile_rule()
    with in_prepare, in_zero:
        prepared_steps(torch.compile(model, backend="aot_eager"), rows, batch=BATCH)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], "the pipelined stages were compiled"
    del model

    breadcrumb("refused: LoRA on the experts split over ep")
    model = om.AutoModelForCausalLM.from_pretrained(paths["dots1"], parallel=om.ParallelConfig(**EP)).train()
    model = adapters.load_adapter(model, paths["expert_adapter"], is_trainable=True)
    with pytest.raises(NotImplementedError, match="peft adapters on the experts split over expert_parallel_size=2"):
        prepared_steps(model, rows, batch=BATCH)
    del model


@pytest.mark.slow
def test_generic_pipeline_training_options(tmp_path):
    import transformers

    paths = save(tmp_path / "models", ["dots1", "granite"])
    for key, targets in (("adapter", ["q_proj", "v_proj"]), ("expert_adapter", ["q_proj", "down_proj"])):
        torch.manual_seed(1)
        base = transformers.AutoModelForCausalLM.from_pretrained(paths["dots1"])
        adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                            init_lora_weights=False))
        if key == "expert_adapter":  # peft wraps the fused experts (their down_proj parameter)
            assert any(n.endswith("mlp.experts") for n, m in adapted.named_modules() if hasattr(m, "lora_A"))
        paths[key] = str(tmp_path / key)
        adapted.save_pretrained(paths[key])
    run_distributed(_worker, 4, paths, str(tmp_path / "scratch"), timeout=900)
