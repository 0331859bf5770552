"""The generic path's rows of the composition table: which axes compose on ``transformers``' own classes (a model
type with no native family, ``oslo_models/generic/``), each decided by the generic path's own validation and each
named with the test that trains it (or checks its refusal).

A row is one layout on one tiny model type of ``tests/generic/models.py``. Its status is decided here, before any
process group, by the same checks ``from_pretrained`` and ``training.prepare`` run on a generic model: the type's
``generic.support.check_parallel`` (its plans, heads, causal-LM class, the modes the path has) on the type's default
``transformers`` config, then ``training.layout_rules.check_training_layout`` (ZeRO, offload, mixed precision).
Two refusals need the model as it is wrapped (peft adapters at tp > 1 not loaded from a folder - a fresh
``get_peft_model`` draws them on the local shards - or on experts split over ep): their reason
comes from ``generic.protocol`` (the text ``training.prepare`` raises); ``torch.compile`` of a whole pipelined model
(``compile_pp``) is ``check_training_layout``'s, for native models too. What a row adds beyond ``ParallelConfig``
and the ZeRO stage is its ``option`` (LoRA, compiled layers, a resumed checkpoint).
``tests/generic/test_generic_composition_rows.py`` checks that each named test exists and trains that type, that the
rows cover every axis the generic path has, and which rows the code refuses; the page ``docs/composition.md``
(``table.render``) prints them.

Not here: per-model refusals made at load from the module tree (a layer sequence parallelism cannot split, a
linear-attention layer under cp): ``om.capabilities(type)`` and ``docs/generic.md`` list those.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .axes import NVME_SCRATCH, Layout, _layout

_MB = dict(num_microbatches=2)
_PP = dict(pipeline_parallel_size=2, **_MB)
_G = "tests/generic/"
TRAINING = _G + "test_generic_training.py::test_generic_types_train_like_transformers"
SUPPORT = _G + "test_generic_support.py::test_refusals_come_before_any_collective"
OPTIONS = _G + "test_generic_pipeline_training_options.py::test_generic_pipeline_training_options"
EXPERT_ZERO = "tests/pipeline/test_pipeline_expert_zero.py::test_pipeline_expert_parallel_zero"
EXPERT_ZERO_EIGHT = ("tests/pipeline/test_pipeline_expert_zero_eight.py::"
                     "test_pipeline_expert_parallel_zero_on_eight_ranks")
PIPELINE_EIGHT = _G + "test_generic_pipeline_eight.py::test_generic_pipeline_on_eight_ranks"
FOUR_AXES = _G + "test_generic_composition.py::test_generic_four_axes_on_eight_ranks"
LORA_TP = _G + "test_generic_lora_tensor_parallel.py::test_generic_lora_tensor_parallel"


@dataclass(frozen=True)
class GenericRow:
    axes: str  # the table's axis names, " x "-joined (plus "lora" / "compile" for the row's option)
    model_type: str  # a tiny type of tests/generic/models.py
    layout: Layout
    test: str  # "path::function" of the test that trains it (or checks the refusal)
    option: str = ""  # beyond ParallelConfig and the ZeRO stage: "LoRA", "compiled layers", ...
    wrapped_refusal: str = ""  # "lora_tp" / "lora_experts" / "compile_pp": training.prepare refuses the wrapped model

    @property
    def describe(self) -> str:
        return " x ".join(part for part in (self.layout.describe(), self.option) if part and part != "single process")


def _row(axes, model_type, test, option="", wrapped_refusal="", **layout) -> GenericRow:
    return GenericRow(axes, model_type, _layout(**layout), test, option, wrapped_refusal)


ROWS = (
    # data parallelism and ZeRO, tensor parallelism through the type's own plan
    _row("tp x dp x z3", "granite", TRAINING, tensor_parallel_size=2, data_parallel_size=2, zero_stage=3),
    _row("tp x dp x z2", "cohere", TRAINING, tensor_parallel_size=2, data_parallel_size=2, zero_stage=2),
    _row("tp x dp x z1 x moe", "olmoe", TRAINING, tensor_parallel_size=2, data_parallel_size=2, zero_stage=1),
    _row("dp x z1", "stablelm", TRAINING, data_parallel_size=4, zero_stage=1),
    _row("dp x z3 x off", "mamba", TRAINING, data_parallel_size=4, zero_stage=3, cpu_offload=True),
    _row("tp x sp x dp x z3", "granite", _G + "test_generic_sequence_parallel.py::test_generic_sequence_parallel",
         tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2, zero_stage=3),
    _row("cp x dp x z3", "granite", _G + "test_generic_context_parallel.py::test_generic_context_parallel",
         context_parallel_size=2, data_parallel_size=2, zero_stage=3),
    _row("cp (all-to-all) x dp x z1", "cohere2", _G + "test_generic_context_parallel.py::test_generic_context_parallel",
         context_parallel_size=2, context_parallel_mode="all_to_all", data_parallel_size=2, zero_stage=1),
    _row("ep x dp x z3", "dots1", _G + "test_generic_expert_parallel.py::test_generic_expert_parallel",
         expert_parallel_size=2, data_parallel_size=4, zero_stage=3),
    _row("ep x tp x sp x dp x z3", "glm4_moe", _G + "test_generic_expert_parallel.py::test_generic_expert_parallel",
         expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True, data_parallel_size=2, zero_stage=3),
    _row("ep x cp x dp x z1", "dots1", _G + "test_generic_expert_parallel.py::test_generic_expert_parallel",
         expert_parallel_size=2, context_parallel_size=2, data_parallel_size=2, zero_stage=1),
    _row("tp x sp x cp x dp x z3", "granite", FOUR_AXES, tensor_parallel_size=2, sequence_parallel=True,
         context_parallel_size=2, data_parallel_size=2, zero_stage=3),
    _row("tp x sp x cp x ep x dp x z3", "glm4_moe", FOUR_AXES, tensor_parallel_size=2, sequence_parallel=True,
         context_parallel_size=2, expert_parallel_size=2, data_parallel_size=2, zero_stage=3),
    _row("tp x dp x lora", "granite", LORA_TP, "LoRA (loaded adapter)", tensor_parallel_size=2, data_parallel_size=2),
    _row("tp x dp x z3 x lora", "granite", LORA_TP, "LoRA (loaded adapter)", tensor_parallel_size=2,
         data_parallel_size=2, zero_stage=3),
    # pipeline parallelism
    _row("pp x dp x z3", "qwen3_next", _G + "test_generic_pipeline.py::test_generic_pipeline", data_parallel_size=2,
         zero_stage=3, **_PP),
    _row("pp x dp x z3 x ac", "cohere2", _G + "test_generic_pipeline.py::test_generic_pipeline",
         data_parallel_size=2, zero_stage=3, activation_checkpointing="full", **_PP),
    _row("pp x tp x dp x z3", "cohere2", _G + "test_generic_pipeline.py::test_generic_pipeline_tensor_parallel",
         tensor_parallel_size=2, data_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x tp x sp", "glm4_moe", _G + "test_generic_pipeline_axes.py::"
         "test_generic_pipeline_with_sequence_and_context_parallel", tensor_parallel_size=2, sequence_parallel=True,
         **_PP),
    _row("pp x cp", "granite", _G + "test_generic_pipeline_axes.py::"
         "test_generic_pipeline_with_sequence_and_context_parallel", context_parallel_size=2, **_PP),
    _row("pp x ep x dp", "dots1", _G + "test_generic_pipeline_experts.py::"
         "test_generic_pipeline_expert_parallel_and_router_loss", expert_parallel_size=2, data_parallel_size=2, **_PP),
    _row("pp x ep x dp x z1", "dots1", EXPERT_ZERO, expert_parallel_size=2, data_parallel_size=2, zero_stage=1, **_PP),
    _row("pp x ep x dp x z2", "dots1", EXPERT_ZERO, expert_parallel_size=2, data_parallel_size=2, zero_stage=2, **_PP),
    _row("pp x ep x dp x z3", "dots1", EXPERT_ZERO, expert_parallel_size=2, data_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x ep x dp x z2 (edp 2)", "dots1", EXPERT_ZERO_EIGHT, expert_parallel_size=2, data_parallel_size=4,
         zero_stage=2, **_PP),
    _row("pp x tp x dp x z1", "cohere2", PIPELINE_EIGHT, tensor_parallel_size=2, data_parallel_size=2, zero_stage=1,
         **_PP),
    _row("tp x sp x pp x cp x ep x z1", "glm4_moe", PIPELINE_EIGHT, tensor_parallel_size=2, sequence_parallel=True,
         context_parallel_size=2, expert_parallel_size=2, zero_stage=1, **_PP),
    _row("tp x sp x pp x cp x ep x z3", "glm4_moe", EXPERT_ZERO_EIGHT, tensor_parallel_size=2, sequence_parallel=True,
         context_parallel_size=2, expert_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x dp x z3 (resumed at dp 4)", "granite", _G + "test_generic_pipeline_resume.py::"
         "test_generic_pipeline_resumes_at_other_layouts", "checkpoint resumed at dp4 / pp2 x tp2",
         data_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x dp x z3 x lora", "granite", _G + "test_generic_pipeline_lora.py::test_generic_pipeline_lora", "LoRA",
         data_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x ep x dp x z3 x off", "dots1", OPTIONS, expert_parallel_size=2, data_parallel_size=2, zero_stage=3,
         cpu_offload=True, **_PP),
    _row("pp x ep x dp x z2 x nvme", "dots1", OPTIONS, expert_parallel_size=2, data_parallel_size=2, zero_stage=2,
         offload="nvme", offload_path=NVME_SCRATCH, **_PP),
    _row("pp x ep x dp x z3 x lora", "dots1", OPTIONS, "LoRA (attention)", expert_parallel_size=2,
         data_parallel_size=2, zero_stage=3, **_PP),
    _row("pp x ep x dp x z1 x ac", "dots1", OPTIONS, expert_parallel_size=2, data_parallel_size=2, zero_stage=1,
         activation_checkpointing="full", **_PP),
    _row("pp x ep x dp x compile", "dots1", OPTIONS, "compiled layers", expert_parallel_size=2, data_parallel_size=2,
         **_PP),
    _row("pp x cp x ac", "granite", OPTIONS, context_parallel_size=2, activation_checkpointing="full", **_PP),
    _row("pp x cp x compile", "granite", OPTIONS, "compiled layers", context_parallel_size=2, **_PP),
    # refused, with the reason the code gives
    _row("grid", "granite", SUPPORT, tensor_parallel_size=4, tensor_parallel_mode="2d"),
    _row("ac (selective)", "xglm", SUPPORT, activation_checkpointing="selective"),
    _row("pp x cp x ac (offload)", "granite", SUPPORT, context_parallel_size=2, activation_checkpointing="offload",
         **_PP),
    _row("pp x ep x dp x ac (partitioned)", "dots1", SUPPORT, expert_parallel_size=2, data_parallel_size=2,
         activation_checkpointing="partitioned", **_PP),
    _row("ep (no expert plan)", "granite", SUPPORT, expert_parallel_size=2, data_parallel_size=2),
    _row("tp (no plan)", "mamba", SUPPORT, tensor_parallel_size=2),
    _row("cp (no attention heads)", "mamba", SUPPORT, context_parallel_size=2),
    _row("tp x dp x lora (fresh adapter)", "granite", _G + "test_generic_lora_refusal.py::"
         "test_generic_lora_at_tp_is_refused", "LoRA from get_peft_model", "lora_tp", tensor_parallel_size=2,
         data_parallel_size=2),
    _row("pp x ep x dp x lora (experts)", "dots1", OPTIONS, "LoRA on the experts", "lora_experts",
         expert_parallel_size=2, data_parallel_size=2, **_PP),
    _row("pp x cp x compile (whole model)", "granite", OPTIONS, "torch.compile(model)", "compile_pp",
         context_parallel_size=2, **_PP),
)


@lru_cache(maxsize=None)
def _representative(model_type: str):
    """``(transformers' causal-LM class, its default config)`` of ``model_type`` (no weights built)."""
    import transformers

    from ..generic.support import transformers_class

    config = transformers.AutoConfig.for_model(model_type)
    return transformers_class("causal_lm", config), config


def decide(row: GenericRow) -> str | None:
    """The reason the generic path refuses ``row`` before any process group (``None``: it composes)."""
    from ..generic.protocol import lora_experts_refusal, lora_tensor_parallel_refusal
    from ..generic.support import check_parallel
    from ..training.layout_rules import check_training_layout

    model_class, config = _representative(row.model_type)
    parallel = row.layout.parallel_config()
    try:
        parallel.resolve_data_parallel_size(row.layout.world_size)
        check_parallel(config, parallel, model_class)
        check_training_layout(parallel, cpu_offload=row.layout.cpu_offload,
                              mixed_precision=row.layout.mixed_precision,
                              compiled=row.wrapped_refusal == "compile_pp")
    except (ValueError, NotImplementedError) as error:
        return str(error)
    if row.wrapped_refusal == "lora_tp":
        return lora_tensor_parallel_refusal(model_class.__name__, parallel.tensor_parallel_size)
    if row.wrapped_refusal == "lora_experts":
        return lora_experts_refusal(parallel.expert_parallel_size, "target_parameters 'down_proj'")
    return None


def render_rows() -> list[str]:
    """The page's section: the composing rows with their tests, then the refused ones with the reason."""
    decided = [(row, decide(row)) for row in ROWS]
    lines = ["", "## The generic path (`transformers`' own classes)", "",
             "Generated from `oslo_models/composition/generic_rows.py`: each row decided by the generic path's own "
             "checks (`generic.support.check_parallel` and the training layout rules, or the wrapped-model refusal "
             "`training.prepare` raises), each trained by the named test against single-process `transformers` "
             "(3 AdamW steps, fp32, 1e-5, rows with unequal label counts) or checking the refusal "
             "(`tests/generic/test_generic_composition_rows.py` checks the names). Per-type refusals made at load from "
             "the module tree are in `om.capabilities(type)` and [the generic path](generic.md).", "",
             "| axes | layout | type | test |", "|---|---|---|---|"]
    for row, reason in decided:
        if reason is None:
            lines.append(f"| {row.axes} | {row.describe} | {row.model_type} | `{row.test}` |")
    lines += ["", "Refused on the generic path, with the reason the code gives:", "",
              "| axes | layout | type | reason | test |", "|---|---|---|---|---|"]
    for row, reason in decided:
        if reason is not None:
            text = reason.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {row.axes} | {row.describe} | {row.model_type} | {text} | `{row.test}` |")
    return lines
