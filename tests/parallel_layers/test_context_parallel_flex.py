"""The context-parallel cores over FlexAttention blocks (issue 52): each ring step (and the all-to-all's gathered
sequence) runs ``flex_attention`` with a ``BlockMask`` of that (query chunk, key chunk) pair and a ``score_mod``
for the cap / ALiBi, merged by the log-sum-exp it returns (``parallel_layers/context_parallel/flex_blocks.py``).

- The block mask alone (no process): over the ring's mirrored chunks with packed documents, padding and a sliding
  window, the mask its blocks imply (full blocks visible, partial ones through ``mask_mod``, absent ones hidden)
  equals the dense rule (``ContextParallelMask.allowed``) entry for entry, with full, partial and absent blocks all
  present; negative control: partial blocks promoted to full leak. (CPU runs the uncompiled Flex kernel, which
  reads ``mask_mod`` only: this is what checks the block lists the compiled kernels read.)
- The CUDA backward's block gradient (``block_vjp``: autograd through each recomputed block, weighted by its
  share of the merged log-sum-exp and a sink) against autograd of a dense softmax over two key blocks + a sink,
  with a differentiable dense stand-in for the Flex block (CPU has no Flex backward).
- One spawned world of 2 gloo processes: the cores (ring, all-to-all) with ``impl="flex"`` against a dense softmax
  (ALiBi + soft-cap + sinks + window + padding + documents + ``d_v != d_qk``: output and gradients, 1e-5;
  ``tests/helpers/dense_attention.py``; control: the documents dropped from the mask is > 1e-3 off); then Gemma 2
  (sliding window 3 on alternate layers, attention soft-cap) loaded with ``attn_implementation="flex_attention"``
  at cp 2, ring and all-to-all, trains 3 AdamW steps on packed rows (restarting position ids, unequal label
  counts: each document's first label and a prompt masked) with the losses and parameters of ``transformers`` on
  the documents one per row (1e-5); negative control: the same rows without their position ids (the documents
  see each other) are off at the first step.
"""
from __future__ import annotations

from dataclasses import replace

import torch

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from oslo_models.parallel_layers.context_parallel import ContextParallelMask, split_sequence
from oslo_models.parallel_layers.context_parallel.attention import choose_impl
from oslo_models.parallel_layers.context_parallel.flex_blocks import block_vjp, pair_block_mask
from oslo_models.parallel_layers.context_parallel.ring import FLEX, TILES, _merge
from tests.helpers.cp_steps import TOL, assert_run_matches, cp_run, reference_run
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dense_attention import check_core
from tests.helpers.dist import breadcrumb, run_distributed

STEPS = 3


# ------------------------------------------------------------------ the block mask alone
def _implied(block_mask, batch: int, s_q: int, s_k: int, promote: bool = False) -> torch.Tensor:
    """``[b, s_q, s_k]``: what the block lists say (full -> visible, partial -> ``mask_mod``, absent -> hidden)."""
    size = block_mask.BLOCK_SIZE[0]
    q_idx, k_idx = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    out = torch.zeros(batch, s_q, s_k, dtype=torch.bool)
    kinds = [(block_mask.kv_num_blocks, block_mask.kv_indices, False),
             (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)]
    for b in range(batch):
        entries = block_mask.mask_mod(torch.tensor(b), 0, q_idx, k_idx).expand(s_q, s_k)
        for num, indices, full in kinds:
            for i in range(num.shape[-1]):
                for j in indices[min(b, num.shape[0] - 1), 0, i, :num[min(b, num.shape[0] - 1), 0, i]].tolist():
                    rows, cols = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
                    out[b, rows, cols] = True if (full or promote) else entries[rows, cols]
    return out


def test_pair_block_mask_matches_the_dense_rule():
    cp, seq, block, window = 2, 64, 4, 9
    index = [split_sequence(torch.arange(seq)[None], r, cp, "ring")[0] for r in range(cp)]
    documents = torch.zeros(2, seq, dtype=torch.long)
    documents[0, 21:] = 1
    documents[0, 40:] = 2
    documents[1, 13:] = 1
    valid = torch.ones(2, seq, dtype=torch.bool)
    valid[1, 50:] = False
    split = (lambda t, r: split_sequence(t, r, cp, "ring"))
    kinds = set()
    for q_rank in range(cp):
        for k_rank in range(cp):
            q_index, k_index = index[q_rank], index[k_rank]
            rule = ContextParallelMask(None, cp, q_rank, (0, 1), "ring", True, torch.stack(index), None)
            expected = rule.allowed(q_index, k_index, split(valid, k_rank), window, split(documents, q_rank),
                                    split(documents, k_rank))[:, 0]
            mask = pair_block_mask(q_index, k_index, causal=True, window=window, q_document=split(documents, q_rank),
                                   k_document=split(documents, k_rank), k_valid=split(valid, k_rank), block=block)
            got = _implied(mask, 2, seq // cp, seq // cp)
            assert torch.equal(got, expected), (q_rank, k_rank)
            kinds |= {"full"} if bool(mask.full_kv_num_blocks.any()) else set()
            kinds |= {"partial"} if bool(mask.kv_num_blocks.any()) else set()
            listed = mask.kv_num_blocks + mask.full_kv_num_blocks
            kinds |= {"absent"} if bool((listed < seq // cp // block).any()) else set()
            if q_rank == 1 and k_rank == 0:  # negative control: partial blocks taken as full leak
                assert not torch.equal(_implied(mask, 2, seq // cp, seq // cp, promote=True), expected)
    assert kinds == {"full", "partial", "absent"}, kinds


def test_choose_impl():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_impl("flex_attention", cpu) == FLEX
    assert choose_impl("sdpa", cpu) == TILES and choose_impl(None, cpu) == TILES
    assert choose_impl("flex_attention", cuda) == FLEX and choose_impl("eager", cuda) == TILES
    assert choose_impl("sdpa", cuda) == TILES  # Flex becomes CUDA's default once it has run on a GPU
    assert choose_impl("sdpa", cuda, dropout=0.1) == TILES
    try:
        choose_impl("flex_attention", cpu, dropout=0.1)
    except ValueError as error:
        assert "dropout" in str(error)
    else:
        raise AssertionError("Flex with attention dropout was not refused")


# ------------------------------------------------------------------ the CUDA backward's block gradient
def _dense_block(q, k, v, scaling, cap):
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * scaling / cap) * cap
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v), lse


def test_block_vjp_matches_autograd_of_the_merge():
    torch.manual_seed(0)
    q, k, v, sink = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 6), torch.randn(3)
    weight, scaling, cap = torch.randn(2, 3, 5, 6), 0.4, 1.5
    halves = (slice(0, 3), slice(3, 8))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    parts = [_dense_block(leaves[0], leaves[1][:, :, h], leaves[2][:, :, h], scaling, cap) for h in halves]
    out, lse = _merge(*parts[0], *parts[1])
    final = torch.logaddexp(lse, sink[None, :, None])
    out = out * torch.exp(lse - final)[..., None]
    (out * weight).sum().backward()
    delta = (weight * out.detach()).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for wrong in (False, True):
        dq.zero_(), dk.zero_(), dv.zero_()
        for h in halves:
            grads = block_vjp(lambda a, b, c: _dense_block(a, b, c, scaling, cap), q, k[:, :, h], v[:, :, h], weight,
                              out.detach(), lse.detach() if wrong else final.detach(), delta)
            dq += grads[0]
            dk[:, :, h] += grads[1]
            dv[:, :, h] += grads[2]
        if wrong:  # negative control: the merged log-sum-exp without the sink
            assert (dq - leaves[0].grad).abs().max() > 1e-3
        else:
            for got, leaf in zip((dq, dk, dv), leaves):
                torch.testing.assert_close(got, leaf.grad, **TOL)


# ------------------------------------------------------------------ the cores and Gemma 2 at cp 2
def _drop_documents(core, mask, sink, cp):
    return core, replace(mask, document=None), sink


# two rows of 16 tokens: documents 6 + 10 and 4 + 12 (the second one's 3-token prompt masked)
DOCUMENTS = [(6, 10), (4, 12)]


def _packed(vocab: int, seed: int):
    ids = torch.randint(3, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    labels = ids.masked_fill(positions == 0, -100)
    labels[1, 4:7] = -100  # a masked prompt: the rows' label counts differ
    return dict(input_ids=ids, position_ids=positions, labels=labels)


def _one_per_row(batch: dict):
    """The documents of ``batch`` one per row, right-padded: ``(ids, mask, labels)``."""
    spans = [(row, start, start + n) for row, lengths in enumerate(DOCUMENTS)
             for start, n in zip((0, lengths[0]), lengths)]
    width = max(stop - start for _, start, stop in spans)
    ids, mask = torch.zeros(len(spans), width, dtype=torch.long), torch.zeros(len(spans), width, dtype=torch.long)
    labels = torch.full((len(spans), width), -100)
    for i, (row, start, stop) in enumerate(spans):
        ids[i, :stop - start], mask[i, :stop - start] = batch["input_ids"][row, start:stop], 1
        labels[i, :stop - start] = batch["labels"][row, start:stop]
    return ids, mask, labels


def reference(path):
    model = hf_class("gemma2").from_pretrained(path, attn_implementation="eager").train()
    rows = (_one_per_row(_packed(model.config.vocab_size, step)) for step in range(STEPS))
    return reference_run(model, (dict(input_ids=ids, attention_mask=mask, labels=labels) for ids, mask, labels in rows))


def _train(path, mode, steps, *, packed=True):
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False, attn_implementation="flex_attention",
                                                    parallel=om.ParallelConfig(context_parallel_size=2,
                                                                               context_parallel_mode=mode)).train()
    assert model.config._attn_implementation == "flex_attention"
    om.distributed.mark_gradients_reduced(model, "caller")  # the chunks' gradients are averaged in cp_run
    split = ContextParallelSplitter(model.parallel_context, shift_labels=True)

    def batch(step):
        whole = _packed(model.config.vocab_size, step)
        if not packed:
            whole.pop("position_ids")
        return split(whole)

    return model, cp_run(model, (batch(step) for step in range(steps)))


def _worker(path, ref_losses, ref_params):
    for mode in ("ring", "all_to_all"):
        breadcrumb(f"core {mode}")
        context = om.ParallelContext.from_config(om.ParallelConfig(context_parallel_size=2,
                                                                   context_parallel_mode=mode))
        check_core(context, mode, {"documents dropped": _drop_documents}, impl=FLEX)
        breadcrumb(f"gemma2 {mode}")
        model, losses = _train(path, mode, STEPS)
        assert_run_matches(mode, model, losses, ref_losses, ref_params)
        _, leaked = _train(path, mode, 1, packed=False)
        assert (leaked[0] - ref_losses[0]).abs() > 1e-4, (mode, leaked[0], ref_losses[0])


def test_flex_cores_and_gemma2_packed_train_at_cp2(tmp_path):
    path = save_tiny(tmp_path / "gemma2", "gemma2")
    losses, params = reference(path)
    run_distributed(_worker, 2, path, losses, params, timeout=900)
