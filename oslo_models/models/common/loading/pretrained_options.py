"""The ``from_pretrained`` keyword arguments of ``transformers`` and what each means for a parallel model.

``transformers.PreTrainedModel.from_pretrained`` accepts a long list of loading options. A parallel model places
its shards by its ``ParallelContext``, not by a device map, and always reads safetensors / ``weights_only`` files,
so each option is either honoured, ignored where ``transformers`` ignores it too, or refused with a ``ValueError``
that says what to use instead. Everything else is a config attribute, as in ``transformers``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# transformers pops and drops these itself (no longer used), or they change nothing for a parallel model.
IGNORED = ("mirror", "_fast_init", "low_cpu_mem_usage", "from_tf", "from_flax", "offload_state_dict", "_from_auto",
           "_from_pipeline", "_commit_hash", "trust_remote_code", "tqdm_class", "weights_only", "use_kernels",
           "adapter_name", "save_peft_format")
# Options that would place, quantize or convert weights in ways a parallel model does not do: a clear error.
REFUSED = {
    "max_memory": "memory limits place weights across devices; choose a layout with parallel=ParallelConfig(...)",
    "offload_folder": "offloading weights to disk is not supported; shard them with parallel=ParallelConfig(...)",
    "offload_buffers": "offloading is not supported; shard the model with parallel=ParallelConfig(...)",
    "quantization_config": "quantized loading is not supported by oslo-models",
    "gguf_file": "GGUF checkpoints are not supported; convert to safetensors first",
    "key_mapping": "key_mapping is not supported: checkpoints use the transformers keys",
    "tp_plan": "use parallel=ParallelConfig(tensor_parallel_size=...) instead of transformers' tp_plan",
    "tp_size": "use parallel=ParallelConfig(tensor_parallel_size=...) instead of tp_size",
    "device_mesh": "use parallel=ParallelConfig(...) (or a ParallelContext) instead of device_mesh",
    "distributed_config": "use parallel=ParallelConfig(...) instead of distributed_config",
    "variant": "weight variants (model.<variant>.safetensors) are not supported; save the variant as the default",
    "adapter_kwargs": "load adapters with peft after loading the model",
}
_SPLITTING_DEVICE_MAPS = ("balanced", "balanced_low_0", "sequential")


class LoadingError(ValueError, RuntimeError):
    """A ``from_pretrained`` call that cannot work as asked. A ``ValueError`` like every usage error here, and a
    ``RuntimeError`` like the error ``transformers`` raises in the same case, so code catching either keeps working."""


@dataclass
class LoadOptions:
    """The loading options ``from_pretrained`` acts on, separated from the config overrides."""

    dtype: object = None
    device: torch.device | None = None
    ignore_mismatched_sizes: bool = False
    output_loading_info: bool = False
    state_dict: dict | None = None
    generation_config: object = None
    attn_implementation: str | None = None
    hub: dict = field(default_factory=dict)  # extra download options for the config: force_download, proxies
    use_safetensors: bool | None = None


def _single_device(device_map) -> torch.device | None:
    """The one device a ``device_map`` names, ``None`` for "auto"/"cpu"-like maps that leave placement to us."""
    if device_map is None or device_map == "auto":
        return None
    if isinstance(device_map, str) and device_map in _SPLITTING_DEVICE_MAPS:
        raise ValueError(f"device_map={device_map!r} splits the model across devices, which oslo-models does with "
                         f"parallel=ParallelConfig(tensor_parallel_size=..., pipeline_parallel_size=...)")
    if isinstance(device_map, dict):
        devices = {torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
                   for d in device_map.values()}
        if len(devices) != 1:
            raise ValueError(f"device_map={device_map!r} places parts of the model on {len(devices)} devices; "
                             "oslo-models splits a model with parallel=ParallelConfig(tensor_parallel_size=..., "
                             "pipeline_parallel_size=...) instead")
        return devices.pop()
    if isinstance(device_map, int):
        return torch.device("cuda", device_map)
    return torch.device(device_map)


def parse_load_options(kwargs: dict, *, dtype) -> LoadOptions:
    """Pop the loading options from ``kwargs`` (what is left are config overrides) and resolve them."""
    if kwargs.get("device_map") is None and torch.get_default_device().type == "meta":
        raise LoadingError("You are using `from_pretrained` with a meta device context manager or "
                           "`torch.set_default_device('meta')`: from_pretrained loads existing weights. For an empty "
                           "model on the meta device use `from_config` or `ModelClass(config)` under the context")
    torch_dtype = kwargs.pop("torch_dtype", None)
    if torch_dtype is not None:
        # transformers' own message for the pre-v5 argument name; the value is honoured
        logger.warning("`torch_dtype` is deprecated! Use `dtype` instead!")
        dtype = dtype if dtype is not None else torch_dtype
    for name, reason in REFUSED.items():
        if kwargs.pop(name, None) not in (None, False, {}):
            raise ValueError(f"from_pretrained({name}=...) is not supported: {reason}")
    for name in IGNORED:
        kwargs.pop(name, None)
    options = LoadOptions(dtype=dtype, device=_single_device(kwargs.pop("device_map", None)),
                          ignore_mismatched_sizes=bool(kwargs.pop("ignore_mismatched_sizes", False)),
                          output_loading_info=bool(kwargs.pop("output_loading_info", False)),
                          state_dict=kwargs.pop("state_dict", None),
                          generation_config=kwargs.pop("generation_config", None),
                          attn_implementation=kwargs.pop("attn_implementation", None),
                          use_safetensors=kwargs.pop("use_safetensors", None))
    for name in ("force_download", "proxies"):
        if name in kwargs:
            options.hub[name] = kwargs.pop(name)
    return options
