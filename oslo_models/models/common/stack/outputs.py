"""``output_attentions`` / ``output_hidden_states``: what ``transformers`` returns, at every parallel layout.

The stacks record them with ``transformers``' own mechanism: the base model's ``forward`` is wrapped by
``capture_parallel_outputs`` (``transformers``' ``capture_outputs`` decorator) and the class declares what to
record in ``_can_record_outputs`` (``{"hidden_states": <block class>, "attentions": <attention class>}``), so the
hooks ``transformers`` installs record each block's input and output and each attention module's weights. Inside the
stack those tensors are split, so this wrapper gathers each recorded tensor back to the single-process layout, and
every rank returns what the single-process model returns:

- hidden states ``[b, s, h]``: under sequence parallelism the residual stream is ``[b, s/tp, h]``; one all-gather
  along the sequence per recorded state (backward: split, as for the stack's own output). The last one is the
  stack's (gathered, normalized) ``last_hidden_state``, as ``transformers`` ties it;
- attention weights ``[b, n, s_q, s_k]``: each rank computes its ``n/tp`` heads; one all-gather along the heads
  (backward: split).

Cost, only when asked for: ``num_layers`` all-gathers of ``b*s*h`` for hidden states and ``num_layers`` all-gathers
of ``b*n*s_q*s_k`` for attentions (per stack), and the full tensors kept on every rank. Attention weights exist only
with the eager kernel: with SDPA (the default) ``transformers`` returns an empty tuple, and so does this; load with
``attn_implementation="eager"`` or call ``set_attn_implementation("eager")``.
"""
from __future__ import annotations

import functools

from transformers.utils.output_capturing import capture_outputs

from ....parallel_layers.mappings import gather_from_sequence_parallel_region, gather_from_tensor_parallel_region


def passed_on(base_outputs) -> dict:
    """The hidden states and attentions a head model returns from its base model's output (``None`` if absent)."""
    return dict(hidden_states=getattr(base_outputs, "hidden_states", None),
                attentions=getattr(base_outputs, "attentions", None))


def _gather_hidden(hidden, full_len: int, group):
    if hidden is None or hidden.shape[1] == full_len:
        return hidden
    return gather_from_sequence_parallel_region(hidden, group, grad_is_partial=False)


def _gather_heads(weights, group):
    return weights if weights is None else gather_from_tensor_parallel_region(weights, group, dim=1)


def gather_recorded_outputs(model, outputs) -> None:
    """Gather, in place, what ``capture_outputs`` recorded on this rank (see the module docstring)."""
    context = model.parallel_context
    if context.tp_size == 1 or context.is_grid:  # grid modes: hidden states stay blocks
        return
    group = context.tp_group
    recorded = getattr(outputs, "hidden_states", None)
    last = getattr(outputs, "last_hidden_state", None)
    if recorded and last is not None:
        outputs["hidden_states"] = tuple(_gather_hidden(h, last.shape[1], group) for h in recorded)
    for key in ("attentions", "cross_attentions"):
        if getattr(outputs, key, None):
            outputs[key] = tuple(_gather_heads(w, group) for w in outputs[key])


def capture_parallel_outputs(forward):
    """``transformers``' ``capture_outputs`` on a base model's ``forward``, then ``gather_recorded_outputs``;
    ``return_dict`` is honoured after the gathering."""
    captured = capture_outputs(forward)

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return_dict = kwargs.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        outputs = captured(self, *args, return_dict=True, **kwargs)
        gather_recorded_outputs(self, outputs)
        return outputs if return_dict else outputs.to_tuple()

    wrapper.records_outputs = True
    return wrapper


def install_recording_hooks(model) -> int:
    """Install ``transformers``' output-recording hooks now on each base model inside ``model`` whose config already
    asks for a recorded output on every call (``output_router_logits=True`` in the MoE configs, or
    ``output_hidden_states`` / ``output_attentions``), as ``transformers`` does on the first forward that records.
    Installed there, a compiled first step enters ``transformers``' hook-installation lock, which ``torch.compile``
    cannot trace (a graph break in every MoE decoder). Returns how many base models got hooks (0 on a
    ``transformers`` without the function)."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # pragma: no cover - older transformers install them on first use only
        return 0
    installed = 0
    for module in model.modules():
        if not getattr(type(module).forward, "records_outputs", False):
            continue
        config = module.config
        keys = getattr(module, "_can_record_outputs", None) or {}
        asks = {"attentions" if key == "cross_attentions" else key for key in keys}
        if any(getattr(config, f"output_{key}", False) for key in asks):
            maybe_install_capturing_hooks(module)
            installed += 1
    return installed
