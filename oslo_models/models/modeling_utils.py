"""``OsloPreTrainedModel``: the ``transformers.PreTrainedModel`` base of every family, with parallelism built in.

A family writes its modules with the plain layers of ``parallel_layers.layers`` and declares, as class data:

- ``parallel_plan``: the ``ParallelPlan`` (module pattern -> style) of that class;
- ``hf_twin``: the ``transformers`` class with the same module tree, used to initialize full weights from the
  seed exactly as ``transformers`` would, before they are sliced (so ``from_config`` at tp=N gives the slices
  of the tp=1 weights).

This base turns the plain model into the parallel one (``parallel_plan.apply``), fills it from a checkpoint
with sliced reads (``from_pretrained``) or from the twin (``from_config``), gathers it back into the plain
layout (``save_pretrained``, ``push_to_hub``), and keeps the ``transformers`` API (``generate``, Auto classes).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from typing import ClassVar

import torch
from torch import nn
from transformers import GenerationConfig, PreTrainedModel

from ..config import ParallelConfig
from ..conversion.checkpoint import CheckpointReader, InMemoryReader
from ..conversion.loading import load_checkpoint_into
from ..conversion.saving import gather_full_state_dict
from ..distributed.agreement import all_or_none
from ..distributed.context import ParallelContext, _world_from_environment
from ..distributed.data_parallel import install_data_parallel_guard
from ..parallel_layers.plan import ParallelPlan
from ..parallel_layers.sequence_parallel import bind_sequence_parallel_region
from .common.loading.pretrained_options import parse_load_options
from .common.rules.parallel_rules import check_rules, spec_rules
from .common.stack.context_parallel import check_context_parallel
from .common.stack.fused_kernels import configure_fused_ops
from .common.stack.outputs import install_recording_hooks


def _resolve_context(parallel: ParallelConfig | ParallelContext | None) -> ParallelContext:
    if isinstance(parallel, ParallelContext):
        return parallel
    return ParallelContext.from_config(parallel or ParallelConfig())


def _parallel_config(parallel: ParallelConfig | ParallelContext | None) -> ParallelConfig:
    """The layout to validate a model config against, whichever form ``parallel=`` took."""
    if isinstance(parallel, ParallelContext):
        return parallel.config
    if parallel is not None and not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel= must be a ParallelConfig or a ParallelContext, got {type(parallel).__name__}")
    return parallel or ParallelConfig()


def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        return getattr(torch, found) if isinstance(found, str) else found
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"Unknown dtype {dtype!r}")
        return getattr(torch, dtype)
    return dtype


def _refuse_pipelined_forward(model, args):
    """Forward pre-hook of a pipelined model: one rank holds only some layers, so a plain forward (or
    ``generate``) cannot run; say what to call instead, before anything half-runs."""
    raise RuntimeError(f"{type(model).__name__} is split into pipeline stages (pipeline_parallel_size="
                       f"{model.parallel_context.pp_size}): each rank holds only its stages' layers, so forward() "
                       f"and generate() cannot run here. Train with model.train_step(batch), evaluate with "
                       f"model.eval_step(batch); for inference, save_pretrained() and load without pipelining.")


class OsloPreTrainedModel(PreTrainedModel):
    """Base class: see the module docstring. ``parallel_context`` says which ranks this model spans."""

    parallel_plan: ClassVar[ParallelPlan] = ParallelPlan({})
    hf_twin: ClassVar[type | None] = None

    def __init__(self, config, *, parallel_context: ParallelContext | None = None, **kwargs):
        super().__init__(config, **kwargs)
        self.parallel_context = parallel_context or ParallelContext.from_config(ParallelConfig())

    # ------------------------------------------------------------------ peft
    @property
    def peft_config(self):
        """The ``peft`` adapter configs (``peft`` sets this attribute on the model it adapts), kept in the instance
        ``__dict__`` under the property's own name (the property, a data descriptor, is looked up first)."""
        try:
            return self.__dict__["peft_config"]
        except KeyError:
            raise AttributeError("peft_config") from None

    @peft_config.setter
    def peft_config(self, value) -> None:
        # peft sets it right after building the adapter layers: replace the ones it built without our parallel
        # layers (a plain LoraConfig; peft gives the model no earlier say), which would compute a split layer wrong
        self.__dict__["peft_config"] = value
        if value:
            from ..adapters.lora import adopt_adapter_layers

            adopt_adapter_layers(self)

    @peft_config.deleter
    def peft_config(self) -> None:
        self.__dict__.pop("peft_config", None)

    # ------------------------------------------------------------------ construction
    @classmethod
    def validate_parallel_config(cls, config, parallel: ParallelConfig) -> None:
        """Raise ``ValueError`` for sizes the family cannot split. Runs before any process group exists, so a bad
        layout never turns into a hang. A stack family's checks are its components' rules (``stack_spec``; see
        ``common/rules/parallel_rules.py``); a family adds its own by overriding and calling ``super()``."""
        spec = getattr(cls, "stack_spec", None)
        if spec is not None:
            check_rules(spec_rules(spec, config), config, parallel)

    @torch.no_grad()
    def _init_weights(self, module):
        """No per-module init for the model's own layers: weights come from a checkpoint or from ``hf_twin`` (see
        ``finish_init``). Plain ``torch`` layers only exist transiently, when ``resize_token_embeddings`` lets
        ``transformers`` build the new full table (``mean_resizing=False``): those get ``transformers``' init."""
        if type(module) in (nn.Linear, nn.Embedding):
            PreTrainedModel._init_weights(self, module)

    def finish_init(self) -> None:
        """Swap in the parallel layers of the plan; off the meta device, initialize like ``transformers``.

        Called at the end of the outermost ``__init__`` (submodules are built with ``submodule=True``).
        """
        type(self).validate_parallel_config(self.config, self.parallel_context.config)  # direct construction too
        check_context_parallel(type(self), self.config, self.parallel_context.config)
        self.parallel_plan.apply(self, self.parallel_context)
        bind_sequence_parallel_region(self, self.parallel_context.sequence_parallel_region)
        configure_fused_ops(self, self.parallel_context.config.fused_ops)  # e.g. bias-GELU on the planned layers
        if self.parallel_context.pp_size > 1:
            # Pipeline parallelism: keep only this rank's stages (layers, and embeddings/head on the first/last
            # stage) before anything is allocated; names stay the Hub names. See oslo_models/pipeline/stage.py.
            from ..pipeline.stage import keep_stage_modules

            keep_stage_modules(self, self.parallel_context)
            self.register_forward_pre_hook(_refuse_pipelined_forward)
        self.tie_parallel_weights()
        install_recording_hooks(self)  # now, not inside a compiled first forward (common/stack/outputs.py)
        if not any(param.is_meta for param in self.parameters()):
            self.initialize_from_twin()
        if self.parallel_context.config.activation_checkpointing is not None:
            self.set_activation_checkpointing(self.parallel_context.config.activation_checkpointing)
        block_plan = self.parallel_context.config.block_plan
        if block_plan is not None and any(choice.checkpoint for choice in block_plan):
            from .common.stack.checkpointing import apply_block_checkpointing  # per-block plan (block_plan.py)

            apply_block_checkpointing(self, [choice.checkpoint for choice in block_plan])
        from .common.stack.long_sequence import apply_long_sequence_options  # tiled_mlp, activation_offload

        apply_long_sequence_options(self)
        # dp x cp > 1: an unwrapped model's first backward raises (distributed/data_parallel.py)
        install_data_parallel_guard(self)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None, **kwargs):
        """``transformers``' hook behind ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` and
        their ``*_disable``: ends in the same ``apply_activation_checkpointing`` as
        ``ParallelConfig.activation_checkpointing`` (``common/stack/checkpointing.py``), so recomputed blocks replay
        this rank's tensor-parallel dropout stream. The mode is ``"full"`` unless ``gradient_checkpointing_kwargs``
        carry ``{"mode": "selective" | "offload" | "partitioned"}``; the other kwargs go to ``torch.utils.checkpoint``.
        """
        from .common.stack.checkpointing import apply_activation_checkpointing

        mode = "full" if enable else None
        keywords = getattr(gradient_checkpointing_func, "keywords", None)
        if enable and keywords and "mode" in keywords:
            keywords = dict(keywords)
            mode = keywords.pop("mode")
            gradient_checkpointing_func = functools.partial(gradient_checkpointing_func.func, **keywords)
        apply_activation_checkpointing(self, mode, gradient_checkpointing_func, **kwargs)

    def set_activation_checkpointing(self, mode: str | None) -> None:
        """Switch activation checkpointing to ``mode`` (``None``, ``"full"``, ``"selective"``, ``"offload"``,
        ``"partitioned"``; see ``ParallelConfig.activation_checkpointing``). Acts in training mode only."""
        from .common.stack.checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(self, mode)

    def tie_parallel_weights(self) -> None:
        """Re-tie the output embedding to the input embedding after the plan replaced the modules."""
        if not getattr(self.config, "tie_word_embeddings", False):
            return
        output, inputs = self.get_output_embeddings(), self.get_input_embeddings()
        if output is not None and inputs is not None:
            output.weight = inputs.weight

    def initialize_from_twin(self) -> None:
        """Initialize the full weights with ``hf_twin(config)`` (same seed, same values as ``transformers``),
        then keep this rank's slices. Costs one full model of host memory while it runs."""
        if self.hf_twin is None:
            raise NotImplementedError(f"{type(self).__name__} has no hf_twin to initialize from")
        twin_config = copy.deepcopy(self.config)  # no from_dict round trip: it would re-validate (problem_type)
        twin = self.hf_twin(twin_config)
        self.load_from_reader(InMemoryReader(twin.state_dict()))

    def load_from_reader(self, reader: CheckpointReader, *, progress: bool = False,
                         ignore_mismatched_sizes: bool = False) -> dict[str, list]:
        if self.parallel_context.pp_size > 1:
            # Pipeline parallelism: read only this stage's tensors (and the tied head from the input embedding).
            from ..pipeline.checkpoint import StageReader

            reader = StageReader.for_model(self, reader)
        return load_checkpoint_into(self, reader, plan=self.parallel_plan, context=self.parallel_context,
                                    base_model_prefix=self.base_model_prefix,
                                    init_std=getattr(self.config, "initializer_range", 0.02),
                                    seed=self.parallel_context.config.seed, progress=progress,
                                    ignore_mismatched_sizes=ignore_mismatched_sizes)

    @classmethod
    def _build_empty(cls, config, context: ParallelContext, dtype: torch.dtype) -> "OsloPreTrainedModel":
        """The parallel model at its local shapes, allocated on ``context.device`` but not filled."""
        with torch.device("meta"):
            model = cls(config, parallel_context=context)
        model.to(dtype)
        model.keep_in_fp32(dtype)
        model.to_empty(device=context.device)
        for module in model.modules():  # non-persistent buffers (rotary frequencies) are in no checkpoint
            if hasattr(module, "reset_buffers"):
                module.reset_buffers()
        model.tie_parallel_weights()
        return model

    @classmethod
    def from_config(cls, config, *, parallel: ParallelConfig | ParallelContext | None = None, dtype=None,
                    **kwargs) -> "OsloPreTrainedModel":
        """A randomly initialized model: the full weights ``transformers`` would draw from the current torch seed,
        sliced for this rank. Seed every rank alike (``torch.manual_seed``) before calling."""
        if kwargs:
            raise ValueError(f"Unknown from_config option(s): {sorted(kwargs)}")
        cls.validate_parallel_config(config, _parallel_config(parallel))
        context = _resolve_context(parallel)
        model = cls._build_empty(config, context, _resolve_dtype(dtype, config))
        with torch.device("cpu"):
            model.initialize_from_twin()
        return model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike | None, *model_args,
                        parallel: ParallelConfig | ParallelContext | None = None, dtype=None, config=None,
                        revision: str | None = None, token: str | bool | None = None, cache_dir=None,
                        local_files_only: bool = False, subfolder: str = "", progress: bool = True,
                        **kwargs) -> "OsloPreTrainedModel":
        """Load a Hub checkpoint (id, cache or local folder) sliced for this rank.

        Each rank builds the model on the meta device, allocates only its shards and reads only its slices
        (safetensors ``get_slice``), so peak host memory per rank is about its shard. ``parallel`` is a
        ``ParallelConfig`` (the process group is initialized from the torchrun environment if needed) or a ready
        ``ParallelContext``. ``dtype``: a torch dtype, its name, ``"auto"`` (the checkpoint's) or ``None`` (fp32).

        ``transformers``' loading options work as there (see ``models/common/loading/pretrained_options.py``):
        ``ignore_mismatched_sizes``, ``output_loading_info`` (returns ``(model, info)``), ``torch_dtype`` (the old
        name of ``dtype``, with ``transformers``' deprecation warning), ``device_map`` (``"auto"``, ``"cpu"`` or one
        device; a map that splits the model is refused: use ``parallel=``), ``state_dict`` with
        ``pretrained_model_name_or_path=None`` and a ``config``, ``attn_implementation``, ``generation_config``.
        Other keyword arguments override config attributes, as in ``transformers``.
        """
        if model_args:
            raise ValueError("Positional model arguments are not supported; pass options by keyword")
        options = parse_load_options(kwargs, dtype=dtype)
        hub = dict(revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only,
                   subfolder=subfolder)
        if pretrained_model_name_or_path is None and (options.state_dict is None or config is None):
            raise ValueError("from_pretrained(None, ...) needs both config= and state_dict=")
        if options.state_dict is not None and pretrained_model_name_or_path is not None:
            raise ValueError("`state_dict` cannot be passed together with a model name: use one of the two")
        if config is None or isinstance(config, (str, os.PathLike)):
            config, unused = cls.config_class.from_pretrained(config or pretrained_model_name_or_path,
                                                              return_unused_kwargs=True, **hub, **options.hub,
                                                              **kwargs)
            if unused:  # transformers hands these to the model's __init__, which rejects them
                raise ValueError(f"Unknown from_pretrained option(s): {sorted(unused)}")
        else:
            config = copy.deepcopy(config)
            for key, value in kwargs.items():  # as transformers: overrides of a given config
                setattr(config, key, value)
        if options.attn_implementation is not None:
            config._attn_implementation = options.attn_implementation
        if pretrained_model_name_or_path is not None:  # as transformers does: TRL reloads a reference model from it
            config.name_or_path = str(pretrained_model_name_or_path)
        expected_type = getattr(cls.config_class, "model_type", None)
        if expected_type and config.model_type != expected_type:
            raise ValueError(f"{cls.__name__} expects a {expected_type!r} checkpoint, got model_type="
                             f"{config.model_type!r} from {pretrained_model_name_or_path}")
        cls.validate_parallel_config(config, _parallel_config(parallel))
        if options.state_dict is not None:
            reader = InMemoryReader(options.state_dict)
        else:
            try:  # file errors show on every rank (each reads every header) before any collective...
                reader = CheckpointReader.open(pretrained_model_name_or_path, **hub)
            except (OSError, ValueError) as error:
                if _world_from_environment()[0] == 1:
                    raise
                reader = error  # ...unless only this rank sees them: agree below, so no rank waits for it
        context = _resolve_context(parallel)
        if options.device is not None and options.device.index is None and options.device.type == context.device.type:
            options.device = context.device
        if options.device is not None and options.device != context.device and context.world_size > 1:
            raise ValueError(f"device_map places the model on {options.device}, but this rank's parallel context "
                             f"uses {context.device}: under torchrun the device follows LOCAL_RANK")
        with all_or_none(context, f"from_pretrained({str(pretrained_model_name_or_path)!r})"):
            if isinstance(reader, Exception):
                raise reader
            model = cls._build_empty(config, context, _resolve_dtype(options.dtype, config))
            info = model.load_from_reader(reader, progress=progress,  # rank-local reads only: no collective inside
                                          ignore_mismatched_sizes=options.ignore_mismatched_sizes)
        if options.device is not None and options.device != context.device:
            model.to(options.device)  # one process: honour the single device the map names
        if options.generation_config is not None:
            model.generation_config = options.generation_config
        elif model.can_generate() and pretrained_model_name_or_path is not None:
            with contextlib.suppress(OSError, ValueError):
                model.generation_config = GenerationConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        model.eval()
        if options.output_loading_info:
            return model, {"missing_keys": set(info["missing_keys"]), "unexpected_keys": set(info["unexpected_keys"]),
                           "mismatched_keys": set(info.get("mismatched_keys", ())), "error_msgs": []}
        return model

    def generate(self, *args, **kwargs):
        """``transformers``' ``generate``, with the same sampled tokens on every tensor-parallel rank whatever each
        rank's seed: the group draws from tp rank 0's RNG (one broadcast per call; see ``models/generation.py``),
        so the tokens equal single-process ``transformers`` seeded like tp rank 0. Call on every rank of the group.
        Under ZeRO-3 the root's parameters stay gathered for the call (``generation.unsharded_root``).
        A pipelined model raises ``RuntimeError`` here, and a batch the tensor-parallel grid cannot split
        ``ValueError``, before any collective."""
        from .generation import check_can_generate, check_grid_batch, sampling_rng_of_group_source, unsharded_root

        check_can_generate(self)
        check_grid_batch(self, args, kwargs)
        if self.parallel_context.ep_size > 1 and kwargs.get("synced_gpus") is None:
            # expert parallelism: every forward is an all-to-all over ep ranks that decode different prompts; a rank
            # whose sequences finish first must keep stepping (transformers' synced_gpus: a finished rank runs
            # dummy forwards until an all-reduce says every rank is done), or the others hang in the all-to-all
            kwargs["synced_gpus"] = True
        with sampling_rng_of_group_source(self.parallel_context), unsharded_root(self):
            return super().generate(*args, **kwargs)

    def _reorder_cache(self, past_key_values, beam_idx: torch.Tensor):
        """Beam search's cache reordering (``transformers`` calls this hook when a model has it). ``beam_idx``
        indexes the global batch; under a grid tensor-parallel mode the cache holds this rank's batch block only,
        so it is reordered with the block's part of ``beam_idx`` (``grid_boundary.local_beam_index``)."""
        if not hasattr(past_key_values, "reorder_cache"):
            raise ValueError(f"{type(self).__name__} cannot use beam search with a cache currently, as the cache "
                             "cannot be reordered")
        context = self.parallel_context
        if context.is_grid:
            from ..parallel_layers.grid_boundary import local_beam_index

            beam_idx = local_beam_index(beam_idx, context)
        past_key_values.reorder_cache(beam_idx)
        return past_key_values

    # ------------------------------------------------------------------ transformers API contract
    def keep_in_fp32(self, dtype: torch.dtype) -> None:
        """As ``transformers``: parameters of ``_keep_in_fp32_modules`` (e.g. T5's ``wo``, against fp16 overflow)
        stay fp32 when the model is loaded in fp16, those of ``_keep_in_fp32_modules_strict`` in fp16 and bf16."""
        patterns = set(self._keep_in_fp32_modules or ()) if dtype == torch.float16 else set()
        if dtype in (torch.float16, torch.bfloat16):
            patterns |= set(self._keep_in_fp32_modules_strict or ())
        if not patterns:
            return
        for name, module in self.named_modules():
            if patterns & set(name.split(".")):
                module.to(torch.float32)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """``set_attn_implementation("eager" | "sdpa" | ...)`` at runtime: every attention here runs through
        ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` (``models/common/attention/attention.py``); ``transformers``'
        heuristic looks for that call in the model's own source file and would miss the shared helper."""
        return True

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        """Replace the module ``get_output_embeddings()`` returns, wherever it sits (``lm_head``, an MLM head's
        ``decoder``)."""
        old = self.get_output_embeddings()
        if old is None:
            self.lm_head = new_embeddings
            return
        for name, module in list(self.named_modules(remove_duplicate=False)):
            if module is old:
                parent, _, child = name.rpartition(".")
                setattr(self.get_submodule(parent) if parent else self, child, new_embeddings)

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Module:
        """``transformers``' ``resize_token_embeddings`` at any tensor-parallel size: the new rows are the ones
        ``transformers`` draws (mean/covariance of the full old vocabulary), the vocab-parallel layers are rebuilt
        with the padding for the new size, ties are kept and ``config.vocab_size`` updated. Collective (all-gather
        of the old tables, broadcast of the new ones): call on every rank. See
        ``models/common/embeddings/resize.py``."""
        from .common.embeddings.resize import resize_token_embeddings

        return resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of, mean_resizing)

    # ------------------------------------------------------------------ training steps
    def train_step(self, batch, *, labels=None, attention_mask=None, optimizer=None, scaler=None, loss_fn=None,
                   loss_inputs=None) -> torch.Tensor:
        """Forward + backward of one batch (``input_ids [b, s]`` or a dict with ``input_ids``, ``labels``,
        ``attention_mask``); returns the loss on every rank. With ``pipeline_parallel_size > 1`` this runs the
        configured pipeline schedule (see ``oslo_models.pipeline.runner``). With ``optimizer``, also steps it;
        ``scaler`` (fp16): a ``GradScaler`` that scales each microbatch's loss inside the schedule. ``loss_fn`` /
        ``loss_inputs`` (pipelined): another objective on the last stage's vocab-split logits of each microbatch
        and the per-row tensors (``oslo_models.post_training``). Collective: call on every rank."""
        return self._pipeline_runner().train_step(batch, labels=labels, attention_mask=attention_mask,
                                                  optimizer=optimizer, scaler=scaler, loss_fn=loss_fn,
                                                  loss_inputs=loss_inputs)

    def eval_step(self, batch, *, labels=None, attention_mask=None) -> torch.Tensor:
        """Forward only; returns the loss on every rank (see ``train_step``)."""
        return self._pipeline_runner().eval_step(batch, labels=labels, attention_mask=attention_mask)

    def _pipeline_runner(self):
        # Built on first use (it creates process groups) and kept in the model's TrainingState: no global state.
        from ..pipeline.runner import pipeline_runner

        return pipeline_runner(self)

    # ------------------------------------------------------------------ saving
    def _tied_keys_to_skip(self) -> set[str]:
        if not getattr(self.config, "tie_word_embeddings", False):
            return set()
        return set((getattr(self, "all_tied_weights_keys", None) or {}).keys())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The plain (unsplit) state dict on global rank 0, ``None`` elsewhere. Collective: call on every rank."""
        return gather_full_state_dict(self, plan=self.parallel_plan, context=self.parallel_context,
                                      skip_keys=self._tied_keys_to_skip())

    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: str | int = "5GB",
                        is_main_process: bool | None = None, state_dict=None, push_to_hub: bool = False,
                        buffer_bytes: int | None = None, **kwargs) -> dict:
        """Write a plain Hub folder that ``transformers`` loads with no conversion. Call on every rank.

        Every rank writes the pieces of each tensor it holds straight into the safetensors shards (sharded at
        ``max_shard_size``, with an index): nothing is gathered, no rank holds more than its own parameters plus a
        host buffer of ``buffer_bytes`` (default 256 MiB), the ranks share the bytes (about ``1/N`` each); global
        rank 0 writes the index, ``config.json`` and ``generation_config.json`` and swaps the folder in atomically
        (a killed save leaves the previous folder as it was). The same writer as ``om.training.save_pretrained``
        (``conversion/model_export.py``); every rank must see ``save_directory`` on the same file system.
        ``is_main_process`` is accepted for ``transformers`` compatibility and ignored (every rank writes).
        Collectives: one ``all_gather_object`` of the ranks' piece lists, then small agreements (no tensor
        collective). Returns this rank's ``{"bytes", "planned_bytes", "seconds"}``.
        """
        from ..conversion.model_export import save_hub_folder

        if kwargs.pop("safe_serialization", True) is False:  # transformers v5 always writes safetensors too
            raise ValueError("save_pretrained(safe_serialization=False) is not supported: oslo-models writes "
                             "safetensors only, as transformers v5 does (it no longer writes pytorch_model.bin)")
        if kwargs:
            raise ValueError(f"Unknown save_pretrained option(s): {sorted(kwargs)}")
        if state_dict is not None:
            raise ValueError("state_dict= is not supported: the model's own parameters are always saved")
        if push_to_hub:
            raise ValueError("Use model.push_to_hub(repo_id) to upload")
        return save_hub_folder(self, save_directory, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes)

    def push_to_hub(self, repo_id: str, *, private: bool | None = None, token: str | bool | None = None,
                    commit_message: str = "Upload model", revision: str | None = None,
                    max_shard_size: str | int = "5GB", buffer_bytes: int | None = None,
                    staging_dir: str | os.PathLike | None = None, **kwargs):
        """Upload the folder :meth:`save_pretrained` writes. Call on every rank: every rank writes its share into a
        staging folder made by global rank 0 (in ``staging_dir``, else its temporary folder; every rank must see
        it, else a ``ValueError`` on every rank before anything is written); after the save's last agreement
        global rank 0 uploads it (``huggingface_hub``) while the others wait. Returns the upload's result on rank
        0, ``None`` elsewhere."""
        from ..conversion.model_export import push_hub_folder

        if kwargs:
            raise ValueError(f"Unknown push_to_hub option(s): {sorted(kwargs)}")
        return push_hub_folder(self, repo_id, private=private, token=token, commit_message=commit_message,
                               revision=revision, max_shard_size=max_shard_size, buffer_bytes=buffer_bytes,
                               staging_dir=staging_dir)
