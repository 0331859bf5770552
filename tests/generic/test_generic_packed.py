"""Packed batches on the generic path attend per document: the same loss and gradients as one document per row.

One spawned world of 2 gloo processes, layouts one after the other: dp 2 (DDP) and tp 2 (the types' own
``base_model_tp_plan``). Types with no native family, each reading the documents another way:

- granite (GQA, a tp plan): ``position_ids`` that restart, no attention mask;
- cohere2 (a tp plan, sliding-window and full layers mixed: one mask per layer type, window 3 inside documents of
  up to 6 tokens): restarting ``position_ids`` and a row padded at the end (``attention_mask`` 0 there);
- xglm (sinusoidal absolute positions, no plan: dp only): ``cu_seqlens`` alone, positions derived per document.

The packed global batch (4 rows of 12 tokens, 2-4 documents each, labels -100 on each document's first token and on
padding) gives, at each layout, the loss and every gradient of single-process ``transformers`` run on the same
documents one per row (padded, masked), summed over tokens and divided by the global label count (fp32, 1e-5).
Negative control, in the reference: plain ``transformers`` on the packed batch (its own mask: documents leak) is
far off the per-document loss, so the parity above cannot pass by accident. Breakage tried: the ``install`` line
in ``generic/loading.py`` removed (every layout fails).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models import training
from oslo_models.utils.documents import cu_seqlens_of, from_position_ids
from tests.generic.models import _IDS, CONFIGS
from tests.helpers.dist import breadcrumb, run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 12
# each row: the document lengths, packed left to right; the last row ends in 2 padding tokens
ROWS = [[5, 7], [3, 4, 5], [6, 6], [2, 4, 4]]
TYPES = {
    "granite": ("position_ids", (1, 2)),  # how the batch marks documents, the tp sizes it runs at
    "cohere2": ("padded", (1, 2)),
    "xglm": ("cu_seqlens", (1,)),
}


def _config(name):
    if name == "cohere2":
        return transformers.Cohere2Config(
            vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
            max_position_embeddings=64, **_IDS)
    return CONFIGS[name]()


def documents():
    gen = torch.Generator().manual_seed(5)
    return [[torch.randint(3, 101, (n,), generator=gen) for n in row] for row in ROWS]


def packed_batch():
    """``input_ids``, ``position_ids`` (restarting; 0 on padding), ``attention_mask``, ``labels`` ``[4, 12]``."""
    ids = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    pos, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, docs in enumerate(documents()):
        start = 0
        for doc in docs:
            end = start + doc.numel()
            ids[r, start:end], pos[r, start:end], mask[r, start:end] = doc, torch.arange(doc.numel()), 1
            labels[r, start + 1:end] = doc[1:]  # the first token is no one's target: it starts a document
            start = end
    return ids, pos, mask, labels


def reference(path):
    """Loss and gradients of plain transformers with each document in a row of its own; the packed-batch loss of
    plain transformers (the negative control)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    docs = [doc for row in documents() for doc in row]
    width = max(doc.numel() for doc in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, doc in enumerate(docs):
        ids[i, :doc.numel()], mask[i, :doc.numel()] = doc, 1
    labels = ids.masked_fill(mask == 0, -100)
    count = int((labels[:, 1:] != -100).sum())
    loss = model(ids, attention_mask=mask, labels=labels, num_items_in_batch=count).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    packed_ids, pos, _, packed_labels = packed_batch()
    with torch.no_grad():
        leaked = model(packed_ids, position_ids=pos, labels=packed_labels, num_items_in_batch=count).loss
    return loss.detach(), grads, leaked


def _inputs(how, ids, pos, mask, labels):
    if how == "position_ids":
        return dict(input_ids=ids, position_ids=pos, labels=labels)
    if how == "padded":
        return dict(input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels)
    docs = from_position_ids(pos)  # cu_seqlens over this rank's rows, as a flattening collator emits them
    return dict(input_ids=ids, cu_seqlens=cu_seqlens_of(docs), labels=labels)


def _full_grad(param):
    grad = param.grad
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _worker(paths, refs):
    ids, pos, mask, labels = packed_batch()
    count = int((labels != -100).sum())
    for name, (how, tp_sizes) in TYPES.items():
        ref_loss, ref_grads, _ = refs[name]
        for tp in tp_sizes:
            breadcrumb(f"{name} tp {tp}")
            context = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=tp))
            model = om.AutoModelForCausalLM.from_pretrained(paths[name], parallel=context).train()
            assert type(model).__module__.startswith("transformers.")
            if context.dp_size > 1:
                model, _ = training.shard_data_parallel(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                                        zero_stage=0)
            rows = slice(context.dp_rank * len(ROWS) // context.dp_size,
                         (context.dp_rank + 1) * len(ROWS) // context.dp_size)
            batch = _inputs(how, ids[rows], pos[rows], mask[rows], labels[rows])
            # this rank's share of the global divisor: DDP averages the gradients over dp
            loss = model(**batch, num_items_in_batch=count / context.dp_size).loss
            loss.backward()
            total = loss.detach().clone()
            if context.dp_size > 1:
                torch.distributed.all_reduce(total, group=context.dp_group)
                total /= context.dp_size
            torch.testing.assert_close(total, ref_loss, msg=lambda m: f"{name} tp {tp} loss: {m}", **TOL)
            for pname, param in training.unwrap_model(model).named_parameters():
                torch.testing.assert_close(_full_grad(param), ref_grads[pname],
                                           msg=lambda m, p=pname: f"{name} tp {tp} {p}: {m}", **TOL)
            del model


@pytest.mark.slow
def test_packed_batches_attend_per_document(tmp_path):
    paths, refs = {}, {}
    for name in TYPES:
        torch.manual_seed(0)
        paths[name] = str(tmp_path / name)
        transformers.AutoModelForCausalLM.from_config(_config(name)).save_pretrained(paths[name])
        refs[name] = reference(paths[name])
        loss, _, leaked = refs[name]
        assert (leaked - loss).abs() > 1e-4, (name, leaked, loss)  # plain transformers: the documents leak
    run_distributed(_worker, 2, paths, refs, timeout=900)


def test_packing_refusals():
    """What cannot attend per document says so instead of training on leaked attention."""
    from oslo_models.generic import packed_attention

    torch.manual_seed(0)
    mamba = transformers.AutoModelForCausalLM.from_config(CONFIGS["mamba"]())
    packed_attention.install(mamba)
    with pytest.raises(NotImplementedError, match="not attention"):
        mamba(torch.ones(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 6]))
    granite = transformers.AutoModelForCausalLM.from_config(CONFIGS["granite"]())
    packed_attention.install(granite)
    with pytest.raises(ValueError, match="cross"):
        granite(torch.ones(2, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 4, 12]))
    ids, mask = torch.randint(3, 101, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    plain = transformers.AutoModelForCausalLM.from_config(CONFIGS["granite"]()).eval()
    plain.load_state_dict(granite.state_dict())
    generated = [m.eval().generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
                 for m in (plain, granite)]
    assert torch.equal(*generated)  # left padding and the cache of generate are not packing
    with pytest.raises(ValueError, match="prepared attention mask"):
        granite(torch.ones(1, 6, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 6]),
                attention_mask=torch.ones(1, 1, 6, 6, dtype=torch.bool))


def test_document_ids_read_every_packing_format():
    """Restarting positions, ``cu_seqlens`` and ``seq_idx`` give the same documents; padding is one document per
    token in a packed batch; left padding (generate's positions) and one document per row are not packing."""
    from oslo_models.utils import documents as D

    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    docs = D.document_ids(2, 6, position_ids=pos, attention_mask=mask)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 10, 11]]
    assert D.cu_seqlens_of(docs).tolist() == [0, 3, 5, 6, 10, 11, 12]
    from_cu = D.document_ids(2, 6, cu_seqlens=torch.tensor([0, 3, 5, 6, 10]))
    from_idx = D.document_ids(2, 6, seq_idx=torch.tensor([[4, 4, 4, 7, 7, 9], [1, 1, 1, 1, 2, 3]]))
    for other in (from_cu, from_idx):  # same partition of every row
        assert torch.equal(other[:, 1:] != other[:, :-1], docs[:, 1:] != docs[:, :-1])
    assert torch.equal(D.positions_in_documents(docs), pos)
    left = torch.tensor([[1, 1, 0, 1, 2]])  # generate: cumsum(mask) - 1, padding set to 1
    assert D.document_ids(1, 5, position_ids=left, attention_mask=torch.tensor([[0, 0, 1, 1, 1]])) is None
    assert D.document_ids(2, 4, position_ids=torch.arange(4)[None]) is None
    with pytest.raises(ValueError, match="non-contiguous"):
        D.document_ids(1, 4, seq_idx=torch.tensor([[0, 1, 0, 1]]))


def prepared_whole_batch(path, parallel, batch):
    """``(prepared model, model, this rank's part of batch)``: the model at ``parallel`` and ``batch`` (every row,
    one optimizer step's worth) through ``training.prepare``'s loader, which splits each sequence into this rank's
    context-parallel chunks with its positions and padding (the targets shifted on the whole sequence first). SGD at
    lr 0: the caller reads gradients."""
    from torch.utils.data import DataLoader

    from accelerate import Accelerator

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel).train()
    rows = [{key: value[row] for key, value in batch.items()} for row in range(batch["input_ids"].shape[0])]
    loader = DataLoader(rows, batch_size=len(rows), collate_fn=lambda items: {
        key: torch.stack([item[key] for item in items]) for key in items[0]})
    wrapped, _, loader = training.prepare(Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.0),
                                          loader)
    (local,) = list(loader)
    assert local["input_ids"].shape[1] == batch["input_ids"].shape[1] // parallel.context_parallel_size
    return wrapped, model, local
