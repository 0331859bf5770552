"""Pipeline parallelism on generic causal LMs (``oslo_models/generic/pipeline_cut.py``, ``pipeline_stage.py``): pp 2 x
dp 2 trains like single-process ``transformers``.

One spawned group of 4 gloo processes, through ``training.prepare`` and ``model.train_step`` with a plain DataLoader
of SFT rows whose label counts differ (prompt masks, right padding, a row with no label; the loss is the global
batch's):

- 1F1B, two microbatches per replica, for every 2025-26 causal LM of ``tests/generic/models.py`` (Apertus' xIELU,
  Llama 4's chunked attention + MoE, Cohere 2's sliding window + tied embeddings, Qwen3-Next's gated DeltaNet + MoE,
  dots1, MiniMax-M2, HunYuan MoE, GraniteMoE-Hybrid's Mamba layers, LFM2-MoE's convolutions, GLM-4-MoE, ERNIE 4.5 MoE,
  EXAONE 4, SmolLM3, OLMo 3), Granite, and three types without a ``base_model_pp_plan``, cut at their
  ``_no_split_modules`` blocks: XGLM (tied, sinusoidal positions), MPT (ALiBi, blocks returning tuples), Mamba (a
  state space model); ZeRO 0-3 spread over them: the logged loss of each of 3 AdamW steps and every parameter after
  them equal ``transformers`` (fp32, 1e-5); each rank holds only its stage's parameters; ``model.save_pretrained``
  of the trained Cohere 2 (tied) and Granite writes the whole model (plain ``transformers`` reads it back); the
  global gradient norm (``training.clip_grad_norm_``) of a step equals ``transformers``' (Cohere 2 at ZeRO-0: the
  tied copy counted once; Granite at ZeRO-3);
- GPipe (ZeRO-0), interleaved 1F1B (ZeRO-3) and zero-bubble (ZeRO-2) on a 4-layer Qwen3-Next (4 stages on 2 ranks
  for the last two), and Cohere 2 with ``activation_checkpointing="full"`` (ZeRO-3): the same;
- negative control: Cohere 2 with the tied embedding's gradient left unsummed across its two stages trains away from
  the reference;
- ``forward`` / ``generate`` of a pipelined model raise with the way out; a non-causal-LM class and a decoder loop
  that changes the hidden states between layers are refused before any process group (pp x tp at ZeRO-1, pp x SP,
  pp x cp and a router loss are not: ``test_generic_pipeline_axes.py``, ``test_generic_pipeline_experts.py``).

A second group of 8 processes runs pp 2 x tp 2 x dp 2 (``test_generic_pipeline_tensor_parallel``): Cohere 2 at
ZeRO-3, Llama 4 at ZeRO-0, Granite at ZeRO-2, equal ``transformers`` the same way.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from oslo_models.generic import support
from oslo_models.generic.install_state import generic_install
from tests.generic.models import CONFIGS, save
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.global_loss import with_global_share
from tests.training.test_global_batch_loss import (
    _collate,
    assert_same_parameters,
    parameters_differ,
    prepared_steps,
    reference_steps,
    sft_rows,
)

RECENT = ("apertus", "llama4_text", "cohere2", "qwen3_next", "dots1", "minimax_m2", "hunyuan_v1_moe",
          "granitemoehybrid", "lfm2_moe", "glm4_moe", "ernie4_5_moe", "exaone4", "smollm3", "olmo3", "vaultgemma",
          "granite_swa")
# name: ZeRO stage; xglm, mpt and mamba have no base_model_pp_plan (mpt's blocks return tuples, mamba is an SSM)
CASES = {name: index % 4 for index, name in enumerate((*RECENT, "granite", "xglm", "mpt", "mamba"))}
SCHEDULES = {"gpipe": 0, "interleaved_1f1b": 3, "zero_bubble": 2}  # on the 4-layer qwen3_next
BATCH = 4  # rows per replica and step: 2 microbatches of 2


def _load(path, schedule="1f1b", zero_stage=0, **options):
    virtual = 2 if schedule in ("interleaved_1f1b", "zero_bubble") else 1
    parallel = om.ParallelConfig(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2,
                                 pipeline_schedule=schedule, virtual_pipeline_size=virtual, zero_stage=zero_stage,
                                 **options)
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()


def _assert_own_stage_only(model, name):
    """This rank's parameters are its layers', plus the embedding on the first stage and the norm / head on the last."""
    layout, pieces = model.pipeline_layout, generic_install(model).pipeline_adapter.pieces
    layers = {f"{pieces.layers}.{index}." for index in layout.local_layers()}
    allowed = ({pieces.embedding + "."} if layout.has_first else set()) | (
        {path + "." for path in pieces.last} if layout.has_last else set())
    names = [n for n, _ in model.named_parameters()]
    stray = [n for n in names if not any(n.startswith(prefix) for prefix in layers | allowed)]
    assert not stray, f"{name}: rank holds parameters of other stages: {stray}"
    assert any(n.startswith(tuple(layers)) for n in names)


def _train_and_compare(name, path, rows, *, schedule="1f1b", zero_stage=0, break_tied=False, **options):
    model = _load(path, schedule, zero_stage, **options)
    _assert_own_stage_only(model, name)
    if break_tied:  # the negative control: each copy of the tied embedding steps on its own stage's gradient
        model._pipeline_runner().tied.groups = []
    model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
    reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
    reference, expected = reference_steps(reference_class.from_pretrained(path).train(), rows,
                                          BATCH * model.parallel_context.dp_size)
    if break_tied:
        assert parameters_differ(model, reference), f"{name}: the unsummed tied gradient matched"
        return model, reference
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name} {schedule} logged losses: {m}")
    assert_same_parameters(model, reference)
    return model, reference


def _assert_saved(model, reference, folder):
    """``model.save_pretrained`` (every rank) writes the whole model: plain ``transformers`` reads the trained
    parameters back."""
    model.save_pretrained(folder)
    if torch.distributed.get_rank() == 0:
        saved = type(reference).from_pretrained(folder).state_dict()
        expected = reference.state_dict()
        assert set(saved) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(saved[key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")


def _assert_grad_norm(name, path, rows, zero_stage):
    """The global gradient norm of one pipelined step (``training.clip_grad_norm_``: every element counted once, on
    its own stage, a tied copy once) equals ``transformers``' on the global batch."""
    from accelerate import Accelerator

    model = _load(path, zero_stage=zero_stage)
    context = model.parallel_context
    batch = _collate(rows[:2 * BATCH])
    local = with_global_share(model, {k: v[context.dp_rank::2] for k, v in batch.items()}, True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = training.prepare(Accelerator(cpu=True), model, optimizer, zero_stage=zero_stage)
    model.train_step(local)
    reference = type(transformers.AutoModelForCausalLM.from_config(model.config)).from_pretrained(path)
    reference(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    torch.testing.assert_close(training.clip_grad_norm_(model, 1e9), expected, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name} gradient norm: {m}")


def _worker(paths, deep_path, out):
    rows = sft_rows(101, 48)
    for name, zero_stage in CASES.items():
        breadcrumb(f"{name} 1f1b zero{zero_stage}")
        model, reference = _train_and_compare(name, paths[name], rows, zero_stage=zero_stage)
        if name in ("cohere2", "granite"):  # tied (ZeRO-2) and untied (ZeRO-2 too: index 14)
            _assert_saved(model, reference, f"{out}/{name}")
    for name, zero_stage in (("cohere2", 0), ("granite", 3)):
        breadcrumb(f"{name} gradient norm zero{zero_stage}")
        _assert_grad_norm(name, paths[name], rows, zero_stage)
    for schedule, zero_stage in SCHEDULES.items():
        breadcrumb(f"qwen3_next x4 {schedule}")
        _train_and_compare("qwen3_next", deep_path, rows, schedule=schedule, zero_stage=zero_stage)
    breadcrumb("cohere2 activation checkpointing")  # transformers' own, on the stages' layers
    _train_and_compare("cohere2", paths["cohere2"], rows, zero_stage=3, activation_checkpointing="full")
    breadcrumb("negative control")
    model, _ = _train_and_compare("cohere2", paths["cohere2"], rows, zero_stage=1, break_tied=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(RuntimeError, match="split into pipeline stages"):
        model(input_ids=ids)
    with pytest.raises(RuntimeError, match="split into pipeline stages"):
        model.generate(ids, max_new_tokens=2)


@pytest.mark.slow
def test_generic_pipeline(tmp_path):
    paths = save(tmp_path / "models", CASES)
    config = CONFIGS["qwen3_next"]()
    config.num_hidden_layers, config.layer_types = 4, list(config.layer_types) * 2
    torch.manual_seed(0)
    deep_path = str(tmp_path / "qwen3_next_4")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(deep_path)
    run_distributed(_worker, 4, paths, deep_path, str(tmp_path / "saved"), timeout=900)


TENSOR_PARALLEL = {"cohere2": 3, "llama4_text": 0, "granite": 2}  # name: ZeRO stage, at pp 2 x tp 2 x dp 2


def _tensor_parallel_worker(paths):
    rows = sft_rows(101, 48)
    for name, zero_stage in TENSOR_PARALLEL.items():
        breadcrumb(f"{name} pp2 x tp2 x dp2 zero{zero_stage}")
        parallel = om.ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2, data_parallel_size=2,
                                     num_microbatches=2, zero_stage=zero_stage)
        model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=parallel).train()
        _assert_own_stage_only(model, name)
        model, logged = prepared_steps(model, rows, batch=BATCH, zero_stage=zero_stage)
        reference_class = type(transformers.AutoModelForCausalLM.from_config(model.config))
        reference, expected = reference_steps(reference_class.from_pretrained(paths[name]).train(), rows, BATCH * 2)
        torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{name} pp2 x tp2 logged losses: {m}")
        assert_same_parameters(model, reference)


@pytest.mark.slow
def test_generic_pipeline_tensor_parallel(tmp_path):
    """pp 2 x tp 2 x dp 2 (8 processes): Cohere 2 (tied embedding split by vocabulary on both stages), Llama 4 (the
    shared expert's in-place add), Granite; the load-time checks of the plan run each local stage alone."""
    run_distributed(_tensor_parallel_worker, 8, save(tmp_path / "models", TENSOR_PARALLEL), timeout=900)


def test_generic_pipeline_refusals():
    """Before any process group: what the generic pipeline cannot run, with the reason."""
    granite = CONFIGS["granite"]()
    causal_lm = transformers.GraniteForCausalLM
    def refusals(**parallel):
        return support.refusals(granite, om.ParallelConfig(pipeline_parallel_size=2, **parallel), causal_lm)

    assert refusals() == [] and refusals(tensor_parallel_size=2) == []
    # pp x tp at ZeRO-1, pp x SP, pp x cp run (test_generic_pipeline_axes.py, test_generic_pipeline_eight.py)
    assert refusals(tensor_parallel_size=2, zero_stage=1, sequence_parallel=True, context_parallel_size=2) == []
    routed = CONFIGS["qwen3_next"]()
    routed.output_router_logits = True
    for extra in ({}, dict(context_parallel_size=2)):  # the stages carry the routing statistics (router_loss.py)
        assert not support.refusals(routed, om.ParallelConfig(pipeline_parallel_size=2, **extra),
                                    transformers.Qwen3NextForCausalLM)
    bert = CONFIGS["megatron-bert"]()
    with pytest.raises(ValueError, match="pipelines causal LMs"):
        support.check_parallel(bert, om.ParallelConfig(pipeline_parallel_size=2), transformers.MegatronBertForMaskedLM)
    assert om.capabilities("granite").supports("pipeline_parallel")


class _Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])

    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


class _ScalingDecoder(_Decoder):
    def forward(self, hidden_states):
        for layer in self.layers:
            hidden_states = layer(hidden_states)
            hidden_states = hidden_states * 2
        return hidden_states


def test_decoder_loops_the_pipeline_cannot_cut():
    """A stage starts from the previous stage's activations: a loop that changes them between layers is refused."""
    from oslo_models.generic.pipeline_cut import layer_call_convention

    holder = torch.nn.Module()
    holder.model = _Decoder()
    assert layer_call_convention(holder, "model.layers") == "tensor"
    holder.model = _ScalingDecoder()
    with pytest.raises(NotImplementedError, match="changes 'hidden_states' between its layers"):
        layer_call_convention(holder, "model.layers")
