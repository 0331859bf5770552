"""Context parallelism with expert parallelism (cp x ep) for the native MoE families (a refusal lifted, issue 52).

The expert groups are carved out of dp x cp (``distributed/context.py``: flattened index ``d * cp + c``), so an ep
group may hold chunks of one sequence; expert gradients are summed over edp and divided by dp x cp
(``distributed/expert_parallel.py``, ZeRO-2/3's ``gradient_scale``, ZeRO-1's ``split_optimizer`` over dp x cp), and
the router's load-balancing loss (``output_router_logits=True``) sums its routing statistics over cp before the
product, so it is the whole sequence's.

One spawned world of 4 gloo processes, dp 2 x cp 2 x ep 2 (ep over the two cp chunks of a replica): 3 AdamW steps
give the losses (token loss of the global batch + each replica's router term), logits, every local gradient and
every local parameter of single-process ``transformers`` (``train_matches``, fp32 1e-5) on right-padded rows of
unequal label counts, for Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (MLA, no router loss) and gpt-oss (sinks),
ring; Mixtral and gpt-oss with all-to-all; Mixtral at ZeRO-1 and ZeRO-3. Negative control: Mixtral whose router
loss is the chunk's own (not reduced over cp) gives another loss than the tested model (> 1e-4, forward only).
"""
from __future__ import annotations

import torch

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from oslo_models.parallel_layers.moe import load_balancing_loss
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import padded_batch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")


def _load(path: str, mode: str = "ring", zero_stage: int = 0):
    return om.AutoModelForCausalLM.from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        data_parallel_size=2, context_parallel_size=2, context_parallel_mode=mode, expert_parallel_size=2,
        zero_stage=zero_stage)).train()


def _train(family: str, path: str, mode: str = "ring", zero_stage: int = 0, steps: int = 3):
    reference = hf_class(family).from_pretrained(path, attn_implementation="eager").train()
    ids, mask, labels = padded_batch(reference.config.vocab_size, batch=4, seq=12)
    call = {} if family == "deepseek_v3" else dict(output_router_logits=True)  # DeepSeek-V3: no router loss
    model = _load(path, mode, zero_stage)
    assert model.parallel_context.ep_size == 2 and model.parallel_context.cp_size == 2
    train_matches(model, reference, dict(input_ids=ids, attention_mask=mask, labels=labels), steps=steps,
                  zero_stage=zero_stage, call=call)


def _worker(paths: dict) -> None:
    for family, path in paths.items():
        breadcrumb(f"{family} ring")
        _train(family, path)
    for family in ("mixtral", "gpt_oss"):
        breadcrumb(f"{family} all_to_all")
        _train(family, paths[family], mode="all_to_all")
    for stage in (1, 3):
        breadcrumb(f"mixtral zero{stage}")
        _train("mixtral", paths["mixtral"], zero_stage=stage)
    # negative control (forward only, so every rank runs the same collectives whatever it finds): the chunk's own
    # router loss (statistics of this rank's tokens only) instead of the whole sequence's
    good, bad = _load(paths["mixtral"]), _load(paths["mixtral"])
    config, context = bad.config, bad.parallel_context
    bad._aux_loss = lambda logits, mask: load_balancing_loss(tuple(logits), config.num_local_experts,
                                                             config.num_experts_per_tok, mask)
    ids, mask, labels = padded_batch(config.vocab_size, batch=4, seq=12)
    replica = {k: v[context.dp_rank::context.dp_size] for k, v in
               dict(input_ids=ids, attention_mask=mask, labels=labels).items()}
    local = ContextParallelSplitter(context, shift_labels=True)(replica)
    with torch.no_grad():
        gap = (good(**local, output_router_logits=True).loss - bad(**local, output_router_logits=True).loss).abs()
    gap = gap.reshape(1).clone()
    torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
    assert gap > 1e-4, gap


def test_cp2_x_ep2_x_dp2_matches_transformers(tmp_path):
    paths = {family: save_tiny(tmp_path / family, family) for family in FAMILIES}
    run_distributed(_worker, 4, paths, timeout=900)
