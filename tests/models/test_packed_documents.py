"""Packed documents attend within themselves in every native core: FlexAttention, SDPA and eager each equal the
same documents run one per row, and each other.

- The Flex block mask, built from per-block document summaries (no ``[s, s]`` tensor), marks no block empty that
  holds an allowed (query, key) pair and no block full that holds a forbidden one, and is exact where documents are
  contiguous id runs; the Flex core (compiled, CPU) equals dense softmax attention with soft-capping, ALiBi, sinks,
  a sliding window, GQA with 3 query heads per rank (not a power of two), a tail block shorter than the block size.
- Natively at tp 2 + sequence parallelism (one world of 2 gloo processes): Llama (restarting ``position_ids`` and a
  padded row), Mistral (sliding window 3 inside documents of up to 7 tokens; ``cu_seqlens`` alone) and Gemma 2
  (logit soft-capping, sliding and full layers): the loss and every gradient through SDPA and eager equal single-
  process ``transformers`` run one document per row (fp32, 1e-5); Flex (forward only: torch has no Flex backward on
  CPU, which is refused with the reason) gives the same loss and the logits of the other cores.
- Negative control: the same packed batch without its document marks (only the padding mask) is far off the
  per-document loss, in the library itself. Breakages tried: the document test dropped from the Flex ``mask_mod``
  (the block-mask and Flex checks fail); ``causal_masks`` keeping the padding mask on the dense path (transformers
  then ignores the packing: SDPA/eager fail for the padded rows).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.parallel_layers.document_attention import DocumentMask, document_attention, document_block_mask
from oslo_models.utils.documents import cu_seqlens_of, document_ids
from tests.helpers.decoders import hf_class, save_tiny
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import assert_grads_match

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 12
ROWS = [[5, 7], [3, 4, 5], [6, 6], [2, 4, 4]]  # document lengths per row; the last row ends in 2 padding tokens
TYPES = {  # how the batch marks documents, the cores that train, the reference's core
    "llama": ("position_ids", ("sdpa", "eager"), "sdpa"),
    "mistral": ("cu_seqlens", ("sdpa", "eager"), "sdpa"),
    "gemma2": ("position_ids", ("eager",), "eager"),  # soft-capping: transformers' SDPA refuses it
}


def _allowed(documents, window=None):
    """Dense reference ``[b, s, s]``: same document, key <= query, inside the window."""
    i = torch.arange(documents.shape[1])
    allowed = (documents[:, :, None] == documents[:, None, :]) & (i[None, :] <= i[:, None])[None]
    if window is not None:
        allowed &= (i[:, None] - i[None, :] < window)[None]
    return allowed


def _packed_documents():
    pos = torch.tensor([list(range(13)) + list(range(20)) + list(range(12)),
                        list(range(30)) + list(range(10)) + [0] * 5])
    mask = torch.tensor([[1] * 45, [1] * 40 + [0] * 5])
    return document_ids(2, 45, position_ids=pos, attention_mask=mask)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_block_mask_from_document_ranges(window):
    block = 16
    for documents, exact in ((_packed_documents(), False), (torch.tensor([[0] * 7 + [1] * 20 + [2] * 18]), True)):
        bm = document_block_mask(documents, window=window, block=block)
        allowed = torch.nn.functional.pad(_allowed(documents, window), (0, 3, 0, 3))  # 45 -> 3 blocks of 16
        b, nb = documents.shape[0], 3
        tiles = allowed.view(b, nb, block, nb, block).permute(0, 1, 3, 2, 4)
        real = torch.zeros(b, nb, block, nb, block, dtype=torch.bool)
        real.view(b, nb * block, nb * block)[:, :45, :45] = True
        tiles_real = real.view(b, nb, block, nb, block)
        some, every = tiles.any(-1).any(-1), (tiles | ~tiles_real.permute(0, 1, 3, 2, 4)).all(-1).all(-1)
        listed = bm.to_dense()[:, 0].bool()  # partial or full
        full = torch.zeros_like(listed)
        for bi in range(b):
            for qi in range(nb):
                for j in bm.full_kv_indices[bi, 0, qi, :bm.full_kv_num_blocks[bi, 0, qi]]:
                    full[bi, qi, j] = True
        assert bool((listed | ~some).all()), "a block with an allowed pair is marked empty"
        assert bool((every | ~full).all()), "a block with a forbidden pair is marked full"
        if exact:
            assert torch.equal(listed, some)


def _dense_attention(q, k, v, documents, *, window=None, softcap=None, slopes=None, sinks=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[2])
    if slopes is not None:
        scores = scores + slopes[None, :, None, None] * (i[None, :] - i[:, None])
    scores = scores.masked_fill(~_allowed(documents, window)[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    return (scores.softmax(-1)[..., :q.shape[2]] @ v).transpose(1, 2)


@pytest.mark.slow
def test_flex_core_equals_dense_attention():
    torch.manual_seed(0)
    documents = _packed_documents()
    q, k, v = torch.randn(2, 3, 45, 8), torch.randn(2, 1, 45, 8), torch.randn(2, 1, 45, 8)
    module = torch.nn.Module()
    mask = DocumentMask(documents, block=16)
    cases = [dict(), dict(sliding_window=5), dict(softcap=2.0), dict(alibi_slopes=torch.rand(3)),
             dict(s_aux=torch.randn(3))]
    with torch.no_grad():
        for extra in cases:
            out, _ = document_attention(module, q, k, v, mask, scaling=8 ** -0.5, **extra)
            expected = _dense_attention(q, k, v, documents, window=extra.get("sliding_window"),
                                        softcap=extra.get("softcap"), slopes=extra.get("alibi_slopes"),
                                        sinks=extra.get("s_aux"))
            torch.testing.assert_close(out, expected, **TOL, msg=lambda m, e=extra: f"{list(e)}: {m}")
    q.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="no backward on CPU"):
        document_attention(module, q, k, v, mask, scaling=1.0)


def documents():
    gen = torch.Generator().manual_seed(5)
    return [[torch.randint(3, 101, (n,), generator=gen) for n in row] for row in ROWS]


def packed_batch():
    """``input_ids``, ``position_ids`` (restarting; 0 on padding), ``attention_mask``, ``labels`` ``[4, 12]``."""
    ids = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    pos, mask, labels = torch.zeros_like(ids), torch.zeros_like(ids), torch.full_like(ids, -100)
    for r, docs in enumerate(documents()):
        start = 0
        for doc in docs:
            end = start + doc.numel()
            ids[r, start:end], pos[r, start:end], mask[r, start:end] = doc, torch.arange(doc.numel()), 1
            labels[r, start + 1:end] = doc[1:]  # a document's first token is no one's target
            start = end
    return ids, pos, mask, labels


def reference(path, model_type, core):
    """Plain transformers with each document in a row of its own: (model with gradients, loss, label count)."""
    model = hf_class(model_type).from_pretrained(path, attn_implementation=core).train()
    docs = [doc for row in documents() for doc in row]
    ids = torch.zeros(len(docs), max(doc.numel() for doc in docs), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        ids[i, :doc.numel()], mask[i, :doc.numel()] = doc, 1
    labels = ids.masked_fill(mask == 0, -100)
    count = int((labels[:, 1:] != -100).sum())
    loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
    loss.backward()
    return model, loss.detach(), count


def _inputs(how):
    ids, pos, mask, labels = packed_batch()
    if how == "cu_seqlens":  # flash-attention offsets over the flattened batch, as a flattening collator emits
        return dict(input_ids=ids, cu_seqlens=cu_seqlens_of(document_ids(4, SEQ, position_ids=pos,
                                                                         attention_mask=mask)), labels=labels)
    return dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels)


def _worker(paths):
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    for model_type, (how, cores, ref_core) in TYPES.items():
        breadcrumb(model_type)
        ref_model, ref_loss, count = reference(paths[model_type], model_type, ref_core)
        model = om.AutoModelForCausalLM.from_pretrained(paths[model_type], parallel=parallel, progress=False).train()
        batch = _inputs(how)
        logits = {}
        for core in cores:
            breadcrumb(f"{model_type} {core}")
            model.set_attn_implementation(core)
            model.zero_grad()
            out = model(**batch, num_items_in_batch=count)
            out.loss.backward()
            torch.testing.assert_close(out.loss.detach(), ref_loss, **TOL,
                                       msg=lambda m, c=core: f"{model_type} {c} loss: {m}")
            assert assert_grads_match(model, ref_model, **TOL) == len(list(model.parameters()))
            logits[core] = out.logits.detach()
        breadcrumb(f"{model_type} flex")
        model.set_attn_implementation("flex_attention")
        with torch.no_grad():
            out = model(**batch, num_items_in_batch=count)
        torch.testing.assert_close(out.loss, ref_loss, **TOL, msg=lambda m: f"{model_type} flex loss: {m}")
        for core, other in logits.items():
            real = batch["labels"] != -100  # logits of padding tokens are nobody's business
            torch.testing.assert_close(out.logits[real], other[real], **TOL)
        with pytest.raises(NotImplementedError, match="no backward on CPU"):
            model(**batch, num_items_in_batch=count)
        # negative control: the documents unmarked (only the padding mask), through the library
        model.set_attn_implementation(cores[0])
        ids, _, mask, labels = packed_batch()
        with torch.no_grad():
            leaked = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
        assert (leaked - ref_loss).abs() > 1e-4, (model_type, leaked, ref_loss)
        del model


@pytest.mark.slow
def test_packed_documents_every_core_tp2_sp(tmp_path):
    paths = {t: save_tiny(tmp_path / t, t) for t in TYPES}
    run_distributed(_worker, 2, paths, timeout=1800)


def test_default_core_for_packed_batches():
    """SDPA (the default) runs packed documents on Flex only where Flex trains (CUDA); CPU keeps the dense mask;
    an explicit flex_attention always gets the Flex core; attention dropout keeps SDPA."""
    from oslo_models.models.common.attention.causal_masks import uses_flex

    config = transformers.LlamaConfig()
    config._attn_implementation = "sdpa"
    assert not uses_flex(config, torch.device("cpu"))
    config._attn_implementation = "flex_attention"
    assert uses_flex(config, torch.device("cpu"))
    config._attn_implementation = "sdpa"
    assert uses_flex(config, torch.device("cuda")) and not uses_flex(config, torch.device("cpu"))
    config.attention_dropout = 0.1
    assert not uses_flex(config, torch.device("cuda"))


@pytest.mark.parametrize("model_type,overrides,core", [("bloom", {}, "eager"), ("falcon", {"alibi": True}, "sdpa")])
def test_alibi_families_attend_per_document(tmp_path, model_type, overrides, core):
    """BLOOM and Falcon build their ALiBi bias into the mask: packed rows (restarting positions, a padded row) keep
    their documents apart there too; loss and every gradient equal transformers one document per row."""
    path = save_tiny(tmp_path / model_type, model_type, **overrides)
    ref_model, ref_loss, count = reference(path, model_type, core)  # the core each family's default matches
    model = om.AutoModelForCausalLM.from_pretrained(path, progress=False).train()
    out = model(**_inputs("position_ids"), num_items_in_batch=count)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), ref_loss, **TOL)
    assert assert_grads_match(model, ref_model, **TOL) == len(list(model.parameters()))
    ids, _, mask, labels = packed_batch()  # negative control: the documents unmarked
    with torch.no_grad():
        leaked = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
    assert (leaked - ref_loss).abs() > 1e-4, (leaked, ref_loss)
