"""Packed documents through the native encoders (BERT, RoBERTa, ALBERT, DistilBERT, ELECTRA, DeBERTa-v2, ModernBERT):
every document of a packed row attends to itself only (bidirectionally), so a packed masked-LM / token-
classification batch gives the loss and every gradient of ``transformers`` run on the same documents one per row
(fp32, 1e-5); the per-row heads (sequence classification, QA, multiple choice, NSP/SOP pre-training) refuse a
packed batch with the reason.

- In process (tp 1): every encoder family's MLM head on a packed batch (restarting ``position_ids``, or
  ``cu_seqlens`` alone: RoBERTa, whose positions start at ``pad_token_id + 1``, and DeBERTa-v2), a token-
  classification head, the ELECTRA discriminator; the refusals.
- One world of 2 gloo processes: BERT (``position_ids``), RoBERTa (``cu_seqlens``), DeBERTa-v2 (relative c2p / p2c
  buckets) and ModernBERT (rotary, local window 2 each side) at tp 2 + SP and at dp 2 (each replica half the
  packed rows, ``num_items_in_batch`` the global count over dp): loss and every gradient equal the single-process
  reference one document per row.
- FlexAttention (forward, CPU: no Flex backward there): BERT and ModernBERT's logits equal the dense mask's.
- Negative control: the same packed rows without their document marks (padding mask only) are far off, in the
  library itself; and with the per-document mask dropped from the encoders' mask hook (tried) every case fails.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.models.registry import family_record
from oslo_models.utils.documents import cu_seqlens_of, document_ids
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import assert_grads_match
from tests.helpers.zoo import tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 12
ROWS = [[5, 7], [3, 4, 5], [6, 6], [2, 4, 4]]  # document lengths per row; the last row ends in 2 padding tokens


def _start(config) -> int:
    """The first position id of a sequence (RoBERTa's start after the padding index)."""
    return config.pad_token_id + 1 if config.model_type in ("roberta", "xlm-roberta", "camembert") else 0


def documents(config):
    gen = torch.Generator().manual_seed(5)
    low = max(config.pad_token_id, getattr(config, "eos_token_id", 0) or 0) + 3  # no special token inside
    return [[torch.randint(low, config.vocab_size, (n,), generator=gen) for n in row] for row in ROWS]


def _labels(doc: torch.Tensor, task: str, salt: int) -> torch.Tensor:
    """Every other token labelled (from a per-document offset), so documents have unequal label counts."""
    labels = doc.clone() if task == "masked_lm" else doc % 3
    keep = (torch.arange(doc.numel()) + salt) % 3 != 0
    return labels.masked_fill(~keep, -100)


def packed_batch(config, task: str = "masked_lm", how: str = "position_ids") -> dict:
    docs = documents(config)
    ids = torch.full((len(ROWS), SEQ), config.pad_token_id, dtype=torch.long)
    pos, mask, labels = torch.zeros_like(ids), torch.zeros_like(ids), torch.full_like(ids, -100)
    for r, row in enumerate(docs):
        start = 0
        for d, doc in enumerate(row):
            end = start + doc.numel()
            ids[r, start:end], mask[r, start:end] = doc, 1
            pos[r, start:end] = torch.arange(doc.numel()) + _start(config)
            labels[r, start:end] = _labels(doc, task, r + d)
            start = end
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if how == "cu_seqlens":
        batch["cu_seqlens"] = cu_seqlens_of(document_ids(*ids.shape, position_ids=pos, attention_mask=mask))
        del batch["attention_mask"]  # the offsets alone mark documents and the trailing padding
    else:
        batch["position_ids"] = pos
    return batch


def one_per_row(config, task: str = "masked_lm") -> dict:
    docs = [doc for row in documents(config) for doc in row]
    ids = torch.full((len(docs), max(d.numel() for d in docs)), config.pad_token_id, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    salts = [r + d for r, row in enumerate(ROWS) for d in range(len(row))]
    for i, (doc, salt) in enumerate(zip(docs, salts)):
        ids[i, :doc.numel()], mask[i, :doc.numel()] = doc, 1
        labels[i, :doc.numel()] = _labels(doc, task, salt)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def save(folder, model_type: str, task: str) -> str:
    cls = family_record(model_type).model_class(task)
    torch.manual_seed(0)
    cls.hf_twin(tiny_config(model_type, num_labels=2 if task == "question_answering" else 3)).save_pretrained(folder)
    return str(folder)


def reference(path, model_type: str, task: str):
    """``transformers`` one document per row: (model with gradients, loss, label count)."""
    cls = family_record(model_type).model_class(task)
    model = cls.hf_twin.from_pretrained(path, attn_implementation="eager").train()
    batch = one_per_row(model.config, task)
    count = int((batch["labels"] != -100).sum())
    loss = model(**batch).loss  # transformers' heads average over the batch's labels
    loss.backward()
    return model, loss.detach(), count


def _check(model, path, model_type, task, how, *, rows=slice(None), scale=1.0, dp_group=None):
    ref_model, ref_loss, count = reference(path, model_type, task)
    batch = {k: (v[rows] if k != "cu_seqlens" else v) for k, v in packed_batch(model.config, task, how).items()}
    if how == "cu_seqlens" and rows != slice(None):
        raise ValueError("dp splits rows: mark documents by position_ids")
    kwargs = dict(num_items_in_batch=count * scale) if task != "pretraining" else {}
    runner = model if dp_group is None else om.data_parallel(model, model.parallel_context)  # averages gradients
    model.zero_grad()
    out = runner(**batch, **kwargs)
    out.loss.backward()
    loss = out.loss.detach().clone()
    if dp_group is not None:  # the global loss: the replicas' shares summed
        torch.distributed.all_reduce(loss, group=dp_group)
        loss = loss * scale
    torch.testing.assert_close(loss, ref_loss, **TOL, msg=lambda m: f"{model_type} {task} {how} loss: {m}")
    assert assert_grads_match(model, ref_model, **TOL) == len(list(model.parameters()))
    # negative control: the documents unmarked (padding mask only) leak into each other
    plain = packed_batch(model.config, task)
    plain.pop("position_ids")
    with torch.no_grad():
        leaked = runner(**{k: v[rows] for k, v in plain.items()}, **kwargs).loss
    if dp_group is not None:
        torch.distributed.all_reduce(leaked, group=dp_group)
        leaked = leaked * scale
    assert (leaked - ref_loss).abs() > 1e-4, (model_type, task, leaked, ref_loss)


CASES = [("bert", "masked_lm", "position_ids"), ("roberta", "masked_lm", "cu_seqlens"),
         ("albert", "masked_lm", "position_ids"), ("distilbert", "masked_lm", "position_ids"),
         ("electra", "masked_lm", "position_ids"), ("deberta-v2", "masked_lm", "cu_seqlens"),
         ("modernbert", "masked_lm", "position_ids"), ("bert", "token_classification", "position_ids"),
         ("modernbert", "token_classification", "cu_seqlens"), ("deberta-v2", "token_classification", "position_ids")]


@pytest.mark.parametrize("model_type,task,how", CASES)
def test_packed_rows_equal_documents_one_per_row(tmp_path, model_type, task, how):
    path = save(tmp_path / model_type, model_type, task)
    model = family_record(model_type).model_class(task).from_pretrained(path, progress=False).train()
    _check(model, path, model_type, task, how)


@pytest.mark.parametrize("model_type,task", [("bert", "sequence_classification"), ("roberta", "question_answering"),
                                             ("modernbert", "sequence_classification"),
                                             ("deberta-v2", "multiple_choice"), ("bert", "pretraining")])
def test_per_row_heads_refuse_packed_batches(tmp_path, model_type, task):
    path = save(tmp_path / model_type, model_type, task)
    model = family_record(model_type).model_class(task).from_pretrained(path, progress=False)
    batch = packed_batch(model.config)
    ids, pos = batch["input_ids"], batch["position_ids"]
    if task == "multiple_choice":
        ids, pos = ids[None].repeat(2, 1, 1), pos[None].repeat(2, 1, 1)
    with pytest.raises(ValueError, match="packed batch"):
        model(input_ids=ids, position_ids=pos)
    cu = cu_seqlens_of(document_ids(*batch["input_ids"].shape, position_ids=batch["position_ids"]))
    if task != "multiple_choice":
        with pytest.raises(ValueError, match="packed batch"):
            model(input_ids=ids, cu_seqlens=cu)
    model(input_ids=ids, attention_mask=torch.ones_like(ids))  # one sequence per row still runs


def test_electra_discriminator_packed(tmp_path):
    """ELECTRA's discriminator (a BCE per token over ``attention_mask``) on a packed batch equals one per row."""
    path = save(tmp_path / "electra", "electra", "pretraining")
    model = family_record("electra").model_class("pretraining").from_pretrained(path, progress=False).train()
    ref = model.hf_twin.from_pretrained(path, attn_implementation="eager").train()
    rows = one_per_row(ref.config)
    rows["labels"] = (rows["input_ids"] % 2) * rows["attention_mask"]
    ref_loss = ref(**rows).loss
    ref_loss.backward()
    batch = packed_batch(model.config)
    batch["labels"] = batch["input_ids"] % 2 * batch["attention_mask"]
    loss = model(**batch).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, **TOL)
    assert assert_grads_match(model, ref, **TOL) == len(list(model.parameters()))


DIST_CASES = [("bert", "masked_lm", "position_ids"), ("roberta", "masked_lm", "cu_seqlens"),
              ("deberta-v2", "masked_lm", "position_ids"), ("modernbert", "token_classification", "position_ids")]


def _worker(paths):
    for layout in ("tp2+sp", "dp2"):
        if layout == "dp2":
            parallel = om.ParallelConfig(data_parallel_size=2)
        else:
            parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
        for model_type, task, how in DIST_CASES:
            if layout == "dp2" and how == "cu_seqlens":
                how = "position_ids"  # each replica's rows: offsets over the whole batch do not apply
            breadcrumb(f"{layout} {model_type} {task} {how}")
            cls = family_record(model_type).model_class(task)
            model = cls.from_pretrained(paths[model_type, task], parallel=parallel, progress=False).train()
            ctx = model.parallel_context
            if layout == "dp2":
                rows = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
                _check(model, paths[model_type, task], model_type, task, how, rows=rows, scale=0.5,
                       dp_group=ctx.dp_group)
            else:
                _check(model, paths[model_type, task], model_type, task, how)
            del model


@pytest.mark.slow
def test_packed_encoders_tp2_sp_and_dp2(tmp_path):
    paths = {(t, task): save(tmp_path / f"{t}-{task}", t, task) for t, task, _ in DIST_CASES}
    run_distributed(_worker, 2, paths, timeout=1200)


@pytest.mark.parametrize("window", [None, 3])
def test_bidirectional_document_block_mask(window):
    """The encoders' Flex mask (``DocumentMask(causal=False)``): a block holding an allowed pair (same document,
    ``|q - k| < window``) is listed, a block listed as full holds only allowed pairs."""
    from oslo_models.parallel_layers.document_attention import document_block_mask

    block, seq = 4, 18
    documents = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4 + [3, 4], [0] * 18])
    i = torch.arange(seq)
    allowed = documents[:, :, None] == documents[:, None, :]
    if window is not None:
        allowed &= ((i[:, None] - i[None, :]).abs() < window)[None]
    bm = document_block_mask(documents, window=window, causal=False, block=block)
    nb = -(-seq // block)
    padded = torch.nn.functional.pad(allowed, (0, nb * block - seq, 0, nb * block - seq))
    tiles = padded.view(2, nb, block, nb, block).permute(0, 1, 3, 2, 4)
    some = tiles.any(-1).any(-1)
    listed = bm.to_dense()[:, 0].bool()
    assert torch.equal(listed | ~some, torch.ones_like(listed)), "an allowed pair's block is missing"
    real = torch.zeros(nb * block, dtype=torch.bool)
    real[:seq] = True
    real_tiles = (real[:, None] & real[None, :]).view(nb, block, nb, block).permute(0, 2, 1, 3)
    for b in range(2):
        for q in range(nb):
            for k in bm.full_kv_indices[b, 0, q, :bm.full_kv_num_blocks[b, 0, q]].tolist():
                assert bool((tiles[b, q, k] | ~real_tiles[q, k]).all()), (b, q, k)
    if window is not None:  # a query block sees key blocks on both sides
        assert bool(listed[1, 2, 1]) and bool(listed[1, 2, 3])


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_encoder_as_decoder_packed(tmp_path, model_type):
    """``BertLMHeadModel`` / ``RobertaForCausalLM`` (``is_decoder``: causal, with a cache in training) on a packed
    batch: the decoders' causal per-document mask; loss and every gradient equal one document per row."""
    cls = family_record(model_type).model_class("causal_lm")
    torch.manual_seed(0)
    cls.hf_twin(tiny_config(model_type, is_decoder=True)).save_pretrained(tmp_path)
    ref = cls.hf_twin.from_pretrained(tmp_path, attn_implementation="eager").train()
    rows = one_per_row(ref.config)
    rows["labels"][:, 0] = -100  # a document's first token is no one's target
    count = int((rows["labels"][:, 1:] != -100).sum())
    ref_loss = ref(**rows).loss
    ref_loss.backward()
    model = cls.from_pretrained(tmp_path, progress=False).train()
    batch = packed_batch(model.config)
    batch["labels"] = batch["labels"].masked_fill(batch["position_ids"] == _start(model.config), -100)
    out = model(**batch, num_items_in_batch=count)
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, **TOL)
    assert assert_grads_match(model, ref, **TOL) == len(list(model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["bert", "modernbert"])
def test_flex_core_forward_equals_sdpa(tmp_path, model_type):
    """The encoders' FlexAttention path (``DocumentMask(causal=False)``; ModernBERT's local layers with the symmetric
    window) gives the dense per-document mask's logits on every real token (forward only: no Flex backward on
    CPU)."""
    path = save(tmp_path, model_type, "masked_lm")
    model = family_record(model_type).model_class("masked_lm").from_pretrained(path, progress=False).eval()
    batch = packed_batch(model.config)
    with torch.no_grad():
        expected = model(**batch).logits
        model.set_attn_implementation("flex_attention")
        got = model(**batch).logits
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], **TOL)
