"""``context_parallel_mode="hybrid"`` (issue 52): all-to-all inside groups of ``context_parallel_all_to_all_size``
consecutive cp ranks, ring across the groups (``parallel_layers/context_parallel/hybrid.py``).

One spawned world of 4 gloo processes at cp 4 with all-to-all groups of 2:

- the core alone against a dense softmax of the whole sequence (ALiBi + soft-cap + sinks + window + padding +
  documents + ``d_v != d_qk``; output and the q, k, v and sink gradients, 1e-5), its ring on fp32 tiles and on
  FlexAttention blocks (``impl="flex"``); negative control: a hybrid that
  forgets its heads' offset in the group (every rank takes the first heads' ALiBi slopes and sinks) is > 1e-3 off;
- the models: 3 AdamW steps equal single-process ``transformers`` (losses, logits, every gradient and parameter,
  ``train_matches``) on right-padded rows of unequal label counts for Llama (grouped-query heads), Gemma 2
  (soft-cap, sliding + global layers), gpt-oss (sinks, router loss on), Bloom (ALiBi) and DeepSeek-V3 (MLA); Llama
  on packed rows (position ids restarting) against ``transformers`` on the same rows.

Plus, without processes: the option's validation and the heads rule.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.models.common.stack.context_parallel import check_context_parallel
from oslo_models.parallel_layers.context_parallel import heads_to_sequence, sequence_to_heads
from oslo_models.parallel_layers.context_parallel.ring import ring_attention
from tests.helpers import zoo
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dense_attention import check_core
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import padded_batch

HYBRID = dict(context_parallel_size=4, context_parallel_mode="hybrid", context_parallel_all_to_all_size=2)
FAMILIES = ("llama", "gemma2", "gpt_oss", "bloom", "deepseek_v3")


def _first_heads(core, mask, sinks, cp):
    """Negative control: the hybrid core with every rank of a group taking the group's first heads' ALiBi slopes
    and sinks (its heads' offset forgotten)."""
    def forgetful(query, key, value, mask, *, scaling, window, softcap, sinks, impl):
        group = mask.hybrid.inner_group
        q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
        first = slice(0, q.shape[1])
        out = ring_attention(q, k, v, mask.ring_view(first), scaling=scaling, window=window, softcap=softcap,
                             sinks=sinks[first], impl=impl)
        return heads_to_sequence(out, group)

    return forgetful, mask, sinks


def _worker(paths: dict) -> None:
    for family, path in paths.items():
        breadcrumb(family)
        reference = hf_class(family).from_pretrained(path, attn_implementation="eager").train()
        model = om.AutoModelForCausalLM.from_pretrained(path, progress=False,
                                                        parallel=om.ParallelConfig(**HYBRID)).train()
        ids, mask, labels = padded_batch(reference.config.vocab_size, batch=2, seq=16)
        call = dict(output_router_logits=True) if family == "gpt_oss" else {}
        train_matches(model, reference, dict(input_ids=ids, attention_mask=mask, labels=labels), steps=3, call=call)
    breadcrumb("llama packed")
    ids = torch.randint(3, 101, (2, 16), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16).contiguous()
    train_matches(om.AutoModelForCausalLM.from_pretrained(paths["llama"], progress=False,
                                                          parallel=om.ParallelConfig(**HYBRID)).train(),
                  hf_class("llama").from_pretrained(paths["llama"], attn_implementation="eager").train(),
                  dict(input_ids=ids, position_ids=positions, labels=ids), call=dict(use_cache=False))
    for impl in ("tiles", "flex"):  # the ring's per-block kernel: fp32 tiles, FlexAttention blocks
        breadcrumb(f"core {impl}")
        check_core(model.parallel_context, "hybrid", {"first heads": _first_heads}, impl=impl)


def test_hybrid_cp4_matches_transformers(tmp_path):
    paths = {family: save_tiny(tmp_path / family, family) for family in FAMILIES}
    run_distributed(_worker, 4, paths, timeout=900)


def test_hybrid_options_are_validated_before_any_process_group():
    assert om.ParallelConfig(**HYBRID).resolve_data_parallel_size(8) == 2
    with pytest.raises(ValueError, match="needs context_parallel_all_to_all_size"):
        om.ParallelConfig(context_parallel_size=4, context_parallel_mode="hybrid")
    with pytest.raises(ValueError, match="needs context_parallel_all_to_all_size"):
        om.ParallelConfig(context_parallel_size=4, context_parallel_mode="hybrid", context_parallel_all_to_all_size=4)
    with pytest.raises(ValueError, match="only used by context_parallel_mode='hybrid'"):
        om.ParallelConfig(context_parallel_size=4, context_parallel_all_to_all_size=2)
    # Bloom's 12 heads over tp 2 are 6 per rank: groups of 4 cannot split them
    with pytest.raises(ValueError, match="divisible by context_parallel_all_to_all_size=4"):
        check_context_parallel(om.BloomForCausalLM, zoo.tiny_config("bloom"), om.ParallelConfig(
            tensor_parallel_size=2, context_parallel_size=8, context_parallel_mode="hybrid",
            context_parallel_all_to_all_size=4))
