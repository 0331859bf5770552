"""Context parallelism for ALiBi (Bloom, Falcon), attention sinks (gpt-oss) and multi-head latent attention
(DeepSeek-V3): refusals lifted (issue 52). The ring and all-to-all cores add each key's ALiBi bias from its
position on the *whole* row, put the sink logit into every row's denominator once (at the final merge), and take
values narrower than keys (MLA's ``d_v < d_qk``).

One spawned world of 2 gloo processes:

- the cores alone, ring and all-to-all, against a dense single-process softmax on the whole sequence: ALiBi +
  soft-cap + sinks + sliding window + padding + packed documents + ``d_v != d_qk`` in one case, output and the
  gradients of q, k, v and the sinks (fp32, 1e-5). Negative controls: ALiBi from chunk-local positions, the sink
  added in every block (``sink + log cp``): both off by > 1e-3;
- the models at cp 2, ring and all-to-all: 3 AdamW steps on right-padded rows of unequal label counts give the
  losses, logits, every gradient and every parameter of single-process ``transformers`` (``train_matches``) for
  Bloom (ALiBi on 12 heads), Falcon with ``alibi=True`` (bfloat16 slopes / sqrt(head_dim)), gpt-oss (sinks,
  sliding + full layers, the router's load-balancing loss with ``output_router_logits=True``) and DeepSeek-V3
  (MLA); packed rows (position ids restarting, each document's first label masked) of all four: the loss and
  every gradient of ``transformers`` on the documents one per row (``transformers``' own packed path is no reference
  here: Bloom takes no position ids, and gpt-oss on the packed rows lets the documents see each other, 2e-3 off).
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

import oslo_models as om
from oslo_models import training
from oslo_models.data import ContextParallelSplitter
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dense_attention import check_core
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import assert_grads_match, padded_batch

TOL = dict(atol=1e-5, rtol=1e-5)
FAMILIES = {"bloom": {}, "falcon": dict(alibi=True), "gpt_oss": {}, "deepseek_v3": {}}


# ------------------------------------------------------------------ the cores alone
def _local_positions(core, mask, sink, cp):
    """Negative control: ALiBi from each chunk's own positions, not the row's."""
    local = torch.arange(mask.token_index.shape[1]).expand(cp, mask.alibi.positions.shape[1], -1)
    return core, replace(mask, alibi=replace(mask.alibi, positions=local)), sink


def _sink_per_block(core, mask, sink, cp):
    """Negative control: the sink in each block's denominator (``cp`` times: ``sink + log cp``)."""
    return core, mask, sink + math.log(cp)


CONTROLS = {"local positions": _local_positions, "sink per block": _sink_per_block}


# ------------------------------------------------------------------ the models
def _load(path: str, mode: str):
    return om.AutoModelForCausalLM.from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        context_parallel_size=2, context_parallel_mode=mode)).train()


def _reference(family: str, path: str):
    # Falcon's transformers default (SDPA) is the arithmetic the library follows (its eager path differs for ALiBi)
    options = {} if family == "falcon" else dict(attn_implementation="eager")
    return hf_class(family).from_pretrained(path, **options).train()


def _packed(vocab: int) -> dict:
    """Two rows of 16 tokens, documents of 6 + 10 tokens (position ids restart), each document's first label
    masked (what the packing collators emit)."""
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(11))
    positions = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16).contiguous()
    return dict(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100))


def _packed_matches_documents(family: str, path: str, mode: str) -> None:
    """``family`` at cp 2 on packed rows: the loss and every gradient of ``transformers`` on the documents one per
    row (right-padded), the same labelled tokens."""
    model = _load(path, mode)
    reference = _reference(family, path)
    batch = _packed(reference.config.vocab_size)
    docs = [(row, 0, 6) for row in range(2)] + [(row, 6, 16) for row in range(2)]
    ids = torch.zeros(4, 10, dtype=torch.long)
    mask = torch.zeros(4, 10, dtype=torch.long)
    for i, (row, start, stop) in enumerate(docs):
        ids[i, :stop - start], mask[i, :stop - start] = batch["input_ids"][row, start:stop], 1
    expected = reference(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    local = ContextParallelSplitter(model.parallel_context, shift_labels=True)(batch)
    wrapped, _ = training.shard_data_parallel(model, torch.optim.AdamW(model.parameters()))
    got = wrapped(**local).loss
    torch.testing.assert_close(got, expected, **TOL)
    expected.backward(), got.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


def _worker(paths: dict) -> None:
    for mode in ("ring", "all_to_all"):
        for family, path in paths.items():
            breadcrumb(f"{family} {mode}")
            reference = _reference(family, path)
            model = _load(path, mode)
            ids, mask, labels = padded_batch(reference.config.vocab_size, batch=2, seq=12)
            call = dict(output_router_logits=True) if family == "gpt_oss" else {}
            train_matches(model, reference, dict(input_ids=ids, attention_mask=mask, labels=labels), steps=3,
                          call=call)
            breadcrumb(f"{family} packed {mode}")
            _packed_matches_documents(family, path, mode)
        breadcrumb(f"cores {mode}")
        check_core(model.parallel_context, mode, CONTROLS)


def test_alibi_sinks_and_latent_attention_train_at_cp2(tmp_path):
    paths = {family: save_tiny(tmp_path / family, family, **overrides) for family, overrides in FAMILIES.items()}
    run_distributed(_worker, 2, paths, timeout=900)
