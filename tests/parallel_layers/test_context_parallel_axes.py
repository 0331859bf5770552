"""Context parallelism with the other axes, on one spawned group of 4 ranks: cp2 x pp2 (ring and all-to-all)
through ``model.train_step`` equals single-process ``transformers`` (the loss of each of 3 AdamW steps, every
gradient, the parameters after them; fp32, atol 1e-5); a resumable checkpoint saved at cp2 x dp2 (ZeRO-1 over
dp x cp) resumes equal to the uninterrupted run, at cp2 x dp2 and resharded to cp1 x dp4."""
from __future__ import annotations

import torch

import oslo_models as om
from oslo_models import training
from oslo_models.data import ContextParallelSplitter
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.models import padded_batch
from tests.helpers.pipeline import ADAMW, assert_pipeline_matches

VOCAB, SEQ = 101, 16


def _batch(rows: int = 4) -> dict:
    ids, mask, labels = padded_batch(VOCAB, batch=rows, seq=SEQ)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _pipeline_matches(path: str, mode: str) -> None:
    cfg = om.ParallelConfig(pipeline_parallel_size=2, context_parallel_size=2, context_parallel_mode=mode,
                            num_microbatches=2)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=cfg, progress=False).train()
    context = model.parallel_context
    assert (context.pp_size, context.cp_size, context.dp_size) == (2, 2, 1)
    reference = decoders.hf_class("llama").from_pretrained(path).train()
    batch = _batch()
    local = ContextParallelSplitter(context)(batch)
    assert_pipeline_matches(model, reference, batch, local=local)


def _zero1(path: str, **options):
    """The Llama at ``options`` with AdamW sharded over dp x cp (ZeRO-1), and its data-parallel step."""
    from accelerate import Accelerator

    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**options), progress=False)
    model, optimizer = training.prepare(Accelerator(cpu=True), model.train(),
                                        torch.optim.AdamW(model.parameters(), **ADAMW), zero_stage=1)
    context = training.unwrap_model(model).parallel_context
    # full rows (no padding): every replica's mean has as many tokens, so the dp mean is the batch mean at dp2 and dp4
    ids = _batch()["input_ids"].clamp(min=1)
    replica = {"input_ids": ids[context.dp_rank::context.dp_size], "labels": ids[context.dp_rank::context.dp_size]}
    local = ContextParallelSplitter(context)(replica)

    def step() -> torch.Tensor:
        loss = model(**local).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss, group=context.dp_group)
        return loss / context.dp_size

    return model, optimizer, step


def _checkpoint_resumes(path: str, folder: str) -> None:
    model, optimizer, step = _zero1(path, context_parallel_size=2)
    step(), step()
    training.save_checkpoint(folder, model, optimizer, step=2)
    expected = [step(), step()]
    for options in (dict(context_parallel_size=2), dict(context_parallel_size=1)):
        resumed, resumed_optimizer, resumed_step = _zero1(path, **options)
        info = training.load_checkpoint(folder, resumed, resumed_optimizer)
        assert info["step"] == 2 and info["same_layout"] == (options["context_parallel_size"] == 2)
        got = [resumed_step(), resumed_step()]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        for (name, a), b in zip(training.unwrap_model(model).named_parameters(),
                                training.unwrap_model(resumed).parameters()):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


HEADS = {"ForSequenceClassification": ("logits",), "ForTokenClassification": ("logits",),
         "ForQuestionAnswering": ("start_logits", "end_logits")}


def _head_matches(path: str, head: str, mode: str) -> None:
    """The head at cp2 x dp2 (DDP over dp x cp): 3 AdamW steps equal transformers' on the whole batch."""
    model = decoders.om_class("llama", head).from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        context_parallel_size=2, context_parallel_mode=mode)).train()
    ids, mask, labels = padded_batch(VOCAB, batch=4, seq=SEQ)
    batch = dict(input_ids=ids, attention_mask=mask)
    if head == "ForSequenceClassification":
        batch["labels"] = torch.tensor([1, 0, 1, 1])
    elif head == "ForTokenClassification":
        batch["labels"] = (labels % 2).masked_fill(labels == -100, -100)
    else:  # one span ends on a padded row's last real token, one starts in rank 1's chunk
        batch.update(start_positions=torch.tensor([3, 5, 0, 9]), end_positions=torch.tensor([15, 13, 2, 11]))
    train_matches(model, decoders.hf_class("llama", head).from_pretrained(path).train(), batch, steps=3,
                  shift_labels=False, outputs=HEADS[head], chunked=head == "ForTokenClassification")


def _worker(paths: dict, folder: str) -> None:
    for head in HEADS:
        _head_matches(paths[head], head, "ring")
    _head_matches(paths["ForSequenceClassification"], "ForSequenceClassification", "all_to_all")
    for mode in ("ring", "all_to_all"):
        _pipeline_matches(paths["llama"], mode)
    _checkpoint_resumes(paths["llama"], folder)


def test_context_parallel_with_pipeline_heads_and_checkpoints_match(tmp_path):
    paths = {"llama": decoders.save_tiny(tmp_path / "llama", "llama", num_hidden_layers=4)}
    for head in HEADS:  # pad 0 (the padded batch's), no classifier dropout (parity in training mode)
        paths[head] = decoders.save_tiny(tmp_path / head, "llama", head, pad_token_id=0, classifier_dropout=0.0)
    run_distributed(_worker, 4, paths, str(tmp_path / "checkpoint"), timeout=600)
