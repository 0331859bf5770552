"""Context parallelism (ring and all-to-all) equals single-process ``transformers`` on the full sequence.

For GPT-2, BERT (MLM) and Llama/Mistral: the loss, the logits of this rank's chunks, every gradient and the
parameters after 3 AdamW steps (fp32, atol 1e-5) on right-padded batches, at cp 2 and 4 both ways, cp2 x tp2 with
sequence parallelism and cp2 x dp2 with ZeRO-1 through ``om.training.prepare``. The batches go through the
``ContextParallelSplitter`` (targets shifted before the split); its chunks reassemble to the input exactly.
One spawned group per world size runs every layout, so each reference is built once per process.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from oslo_models.parallel_layers.context_parallel import merge_sequence, ring, split_sequence, token_index
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import save_tiny, tiny_bert_config
from tests.helpers.layouts import train_matches
from tests.helpers.models import padded_batch, save_tiny_gpt2

VOCAB, SEQ = 101, 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    return {"gpt2": save_tiny_gpt2(root / "gpt2"),
            "bert": save_tiny(root / "bert", transformers.BertForMaskedLM, tiny_bert_config()),
            "llama": decoders.save_tiny(root / "llama", "llama"),
            "mistral": decoders.save_tiny(root / "mistral", "mistral")}


def _batch(family: str, rows: int = 4, padded: bool = True, packed: bool = False) -> dict:
    """Right-padded rows of lengths 16, 14, 12, 10 (whole chunks of padding at cp4); MLM labels on half the tokens,
    token types for BERT. ``padded=False``: full rows and no attention mask (the kernels' unmasked causal path);
    ``packed``: and two documents per row (6 + 10 tokens), marked by ``position_ids`` that restart at 0."""
    ids, mask, labels = padded_batch(VOCAB, batch=rows, seq=SEQ)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if not padded:
        batch = dict(input_ids=ids.masked_fill(mask == 0, 7), labels=ids.masked_fill(mask == 0, 7))
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(10)]).expand(rows, SEQ).contiguous()
    if family == "bert":
        batch["labels"] = labels.masked_fill(torch.arange(SEQ) % 2 == 1, -100)
        batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(rows, SEQ).contiguous() * mask
    return batch


def _reference(family: str, path: str):
    cls = {"gpt2": transformers.GPT2LMHeadModel, "bert": transformers.BertForMaskedLM}.get(family)
    cls = cls or decoders.hf_class(family)
    return cls.from_pretrained(path).train()


def _load(family: str, path: str, **options):
    cfg = om.ParallelConfig(**options)
    auto = om.AutoModelForMaskedLM if family == "bert" else om.AutoModelForCausalLM
    return auto.from_pretrained(path, parallel=cfg, progress=False).train()


def _train_matches(family: str, path: str, *, zero_stage: int = 0, steps: int = 3, padded: bool = True,
                   packed: bool = False, **options) -> None:
    """``steps`` AdamW steps at the layout ``options`` (``tests/helpers/layouts.py``)."""
    call = dict(use_cache=False) if packed else {}  # transformers masks packed documents only without a cache
    train_matches(_load(family, path, **options), _reference(family, path),
                  _batch(family, padded=padded and not packed, packed=packed), zero_stage=zero_stage, steps=steps,
                  shift_labels=family != "bert", call=call)


def _cp2_worker(checkpoints: dict) -> None:
    for mode in ("ring", "all_to_all"):
        for family, path in checkpoints.items():
            _train_matches(family, path, context_parallel_size=2, context_parallel_mode=mode)
        _train_matches("gpt2", checkpoints["gpt2"], context_parallel_size=2, context_parallel_mode=mode,
                       padded=False, steps=1)
        _train_matches("llama", checkpoints["llama"], context_parallel_size=2, context_parallel_mode=mode,
                       packed=True, steps=1)
    ring._TILE_ELEMENTS = 4 * 8 * 8 * 3  # [b, n, rows, s_k] tiles of 3 of the 8 query rows: exact too
    _train_matches("mistral", checkpoints["mistral"], context_parallel_size=2, steps=1)


def test_cp2_ring_and_all_to_all_match_transformers(checkpoints):
    run_distributed(_cp2_worker, 2, checkpoints, timeout=600)


def _cp4_worker(checkpoints: dict) -> None:
    for mode in ("ring", "all_to_all"):
        for family in ("gpt2", "bert", "llama"):
            # llama's 8 heads: 2 per rank at all-to-all cp4 (and its 2 key/value heads are repeated to split)
            _train_matches(family, checkpoints[family], context_parallel_size=4, context_parallel_mode=mode)
    # unpadded: the ring's causal chunk pairs run through the CPU flash kernel (full, causal and hidden pairs)
    _train_matches("llama", checkpoints["llama"], context_parallel_size=4, padded=False, steps=1)
    for family in ("gpt2", "llama"):
        _train_matches(family, checkpoints[family], context_parallel_size=2, tensor_parallel_size=2,
                       sequence_parallel=True)
    _train_matches("bert", checkpoints["bert"], context_parallel_size=2, tensor_parallel_size=2,
                   sequence_parallel=True, context_parallel_mode="all_to_all")
    for family in ("gpt2", "bert"):
        _train_matches(family, checkpoints[family], zero_stage=1, context_parallel_size=2, data_parallel_size=2)


def test_cp4_and_cp2_with_tp_sp_and_zero1_match_transformers(checkpoints):
    run_distributed(_cp4_worker, 4, checkpoints, timeout=600)


# ---------------------------------------------------------------------------------------------- no processes
def test_chunks_reassemble_and_ring_chunks_mirror():
    x = torch.arange(2 * 24).view(2, 24)
    for mode, cp in (("ring", 2), ("ring", 4), ("all_to_all", 3)):
        parts = [split_sequence(x, r, cp, mode) for r in range(cp)]
        assert torch.equal(merge_sequence(parts, mode), x)
        for r, part in enumerate(parts):
            assert torch.equal(part[0], token_index(part.shape[1], r, cp, mode))
    # ring: rank 0 holds the first and the last chunk (causal work balanced)
    assert token_index(4, 0, 4, "ring").tolist() == [0, 1, 14, 15]


def test_splitter_shifts_before_splitting():
    ids = torch.arange(1, 17).view(1, 16)
    batch = dict(input_ids=ids, labels=ids.clone(), attention_mask=torch.ones_like(ids))
    parts = [ContextParallelSplitter(cp_rank=r, cp_size=2, mode="ring")(batch) for r in range(2)]
    # rank 0 holds tokens 1-4 and 13-16: the target of token 4 (5) lives on rank 1's chunk, but is kept
    assert parts[0]["shift_labels"].tolist() == [[2, 3, 4, 5, 14, 15, 16, -100]]
    assert torch.equal(merge_sequence([p["shift_labels"] for p in parts], "ring")[0, :-1], ids[0, 1:])
    with pytest.raises(ValueError, match="divisible by 4"):
        ContextParallelSplitter(cp_rank=0, cp_size=2, mode="ring")(dict(input_ids=torch.ones(1, 6, dtype=torch.long)))
    ContextParallelSplitter(cp_rank=0, cp_size=2, mode="all_to_all")(dict(input_ids=torch.ones(1, 6, dtype=torch.long)))


def test_config_errors():
    with pytest.raises(ValueError, match="context_parallel_mode"):
        om.ParallelConfig(context_parallel_size=2, context_parallel_mode="ulysses")
    with pytest.raises(ValueError, match="positive int"):
        om.ParallelConfig(context_parallel_size=0)
    om.ParallelConfig(context_parallel_size=2, expert_parallel_size=2)  # experts carved out of dp x cp
    om.ParallelConfig(context_parallel_size=2, expert_parallel_size=2, pipeline_parallel_size=2)  # cp x ep x pp runs
    with pytest.raises(ValueError, match="context_parallel_size=2"):
        om.ParallelConfig(context_parallel_size=2, tensor_parallel_size=2, data_parallel_size=2
                          ).resolve_data_parallel_size(4)
    assert om.ParallelConfig(context_parallel_size=2, tensor_parallel_size=2).resolve_data_parallel_size(8) == 2


def test_build_dataloader_hands_each_cp_rank_its_chunks():
    from types import SimpleNamespace

    data = [dict(input_ids=torch.arange(i, i + 8), labels=torch.arange(i, i + 8)) for i in range(4)]
    parts = []
    for rank in range(2):
        ctx = SimpleNamespace(dp_rank=0, dp_size=1, cp_rank=rank, cp_size=2,
                              config=SimpleNamespace(context_parallel_mode="ring"))
        parts.append(next(iter(om.data.build_dataloader(data, 2, parallel_context=ctx, shuffle=False))))
    assert parts[1]["input_ids"].tolist() == [[2, 3, 4, 5], [3, 4, 5, 6]]  # chunks 1 and 2 of 4
    for key in ("input_ids", "labels", "shift_labels"):
        whole = merge_sequence([p[key] for p in parts], "ring")
        expected = torch.stack([d["labels"] for d in data[:2]])
        expected = torch.nn.functional.pad(expected, (0, 1), value=-100)[:, 1:] if key == "shift_labels" else expected
        assert torch.equal(whole, expected), key


def test_model_level_errors_before_any_collective():
    from oslo_models.models.common.stack.context_parallel import check_context_parallel
    from tests.helpers.models import tiny_gpt2_config

    a2a = om.ParallelConfig(context_parallel_size=3, context_parallel_mode="all_to_all")
    with pytest.raises(ValueError, match=r"heads per tensor-parallel rank .* divisible by context_parallel_size=3"):
        check_context_parallel(om.GPT2LMHeadModel, tiny_gpt2_config(), a2a)
    check_context_parallel(om.GPT2LMHeadModel, tiny_gpt2_config(), om.ParallelConfig(context_parallel_size=3))
    # T5 / BART: the encoder-decoder LMs run under cp (test_t5_context_parallel, test_bart_context_parallel); an
    # encoder alone and the pooling heads do not
    check_context_parallel(om.T5ForConditionalGeneration, transformers.T5Config(),
                           om.ParallelConfig(context_parallel_size=2))
    for cls, config in ((om.T5EncoderModel, transformers.T5Config()),
                        (om.BartForSequenceClassification, transformers.BartConfig())):
        with pytest.raises(NotImplementedError, match=cls.__name__):
            check_context_parallel(cls, config, om.ParallelConfig(context_parallel_size=2))
    # attention dropout and the stack decoders' classification heads run under cp; the encoders' heads do not
    cp2 = om.ParallelConfig(context_parallel_size=2)
    for cls in (om.GPT2LMHeadModel, om.GPT2ForSequenceClassification, om.GPT2ForTokenClassification,
                om.GPT2ForQuestionAnswering):
        check_context_parallel(cls, tiny_gpt2_config(attn_pdrop=0.1), cp2)
    with pytest.raises(NotImplementedError, match="BertForSequenceClassification"):
        check_context_parallel(om.BertForSequenceClassification, transformers.BertConfig(), cp2)
    # all-to-all under a grid: the heads per grid column block (8 / q=2 = 4) must split over cp
    grid = om.ParallelConfig(context_parallel_size=3, context_parallel_mode="all_to_all", tensor_parallel_size=4,
                             tensor_parallel_mode="2d")
    with pytest.raises(ValueError, match=r"grid's q \(2d\)=2 = 4\) divisible by context_parallel_size=3"):
        check_context_parallel(om.GPT2LMHeadModel, tiny_gpt2_config(n_head=8), grid)

