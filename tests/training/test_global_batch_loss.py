"""The loss of a training step is the global batch's (``oslo_models/training/global_batch.py``), end to end.

A user's loop over ``om.training.prepare`` (a plain ``DataLoader``, ``accelerator.accumulate`` /
``accelerator.backward``, or ``model.train_step`` when pipelined), ``om.training.Trainer``, native and generic-path
models: after 3 AdamW steps every parameter equals single-process ``transformers`` trained on each step's whole
global batch in one forward (fp32, 1e-5), where the rows carry different numbers of label tokens (SFT prompt masks of
varying length and right padding; masked-LM rates varying per row; one micro-batch with no label at all). The logged
loss (the mean over ranks of what the loop accumulates) is the global batch's on every rank. Negative control: the
per-replica mean (``average_tokens_across_devices=False``) misses the same reference.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.data import DataLoader

import oslo_models as om
from oslo_models import training
from oslo_models.generic import is_generic
from tests.generic import models as generic_models
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import save_tiny, tiny_bert_config
from tests.helpers.models import expected_shard, tp_local
from tests.helpers.pipeline import ADAMW

STEPS, SEQ, MASK_ID = 3, 16, 3


# ---------------------------------------------------------------------------------------------------- data
def sft_rows(vocab: int, count: int, seed: int = 0) -> list[dict]:
    """Causal-LM rows: a prompt of 0..SEQ-4 tokens masked from the loss, then right padding of 0..5 tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        ids = torch.randint(4, vocab, (SEQ,), generator=gen)
        length = SEQ - int(torch.randint(0, 6, (1,), generator=gen))
        prompt = int(torch.randint(0, SEQ - 4, (1,), generator=gen))
        mask = (torch.arange(SEQ) < length).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[:prompt] = -100
        if index == 5:  # a micro-batch row with no label token at all
            labels[:] = -100
        rows.append(dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, labels=labels))
    return rows


def mlm_rows(vocab: int, count: int, seed: int = 1) -> list[dict]:
    """Masked-LM rows: each row masks its own fraction (5%-80%) of its tokens; some rows right-padded."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        ids = torch.randint(4, vocab, (SEQ,), generator=gen)
        length = SEQ - 3 * (index % 3)
        mask = (torch.arange(SEQ) < length).long()
        rate = 0.05 + 0.75 * float(torch.rand((), generator=gen))
        chosen = (torch.rand(SEQ, generator=gen) < rate) & (mask == 1)
        if index in (2, 3):  # no label in these rows
            chosen[:] = False
        labels = ids.masked_fill(~chosen, -100)
        rows.append(dict(input_ids=ids.masked_fill(chosen, MASK_ID).masked_fill(mask == 0, 0), attention_mask=mask,
                         labels=labels))
    return rows


def _collate(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


# ---------------------------------------------------------------------------------------------------- both sides
def reference_steps(reference, rows: list[dict], rows_per_step: int) -> tuple[torch.nn.Module, list[float]]:
    """Single-process ``transformers``: each step's rows in one forward (the token mean of the global batch)."""
    optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    losses = []
    for step in range(STEPS):
        loss = reference(**_collate(rows[step * rows_per_step:(step + 1) * rows_per_step])).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        losses.append(loss.item())
    return reference, losses


def prepared_steps(model, rows: list[dict], *, batch: int, accumulation: int = 1, zero_stage: int = 0,
                   average: bool = True, collate_fn=_collate, **prepare_options) -> tuple[torch.nn.Module, list[float]]:
    """The documented loop over ``training.prepare`` with a plain, unshuffled ``DataLoader``: rank ``d`` of ``dp``
    gets batches ``d, d + dp, ...``, so step ``k`` covers rows ``[k R, (k + 1) R)``, ``R = batch * dp * accumulation``
    as the reference's step (``prepare_options``: more keywords of ``training.prepare``, e.g. ``cpu_offload``).
    Returns the unwrapped model and the logged (world-mean) loss of every step."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    loader = DataLoader(rows, batch_size=batch, shuffle=False, collate_fn=collate_fn)
    model, optimizer, loader = training.prepare(accelerator, model, optimizer, loader, zero_stage=zero_stage,
                                                average_tokens_across_devices=average, **prepare_options)
    pipelined = training.unwrap_model(model).parallel_context.pp_size > 1
    running, losses = torch.zeros(()), []
    for micro in loader:
        with accelerator.accumulate(model):
            if pipelined:
                loss = model.train_step(micro)
            else:
                loss = model(**micro).loss
                accelerator.backward(loss)
            running += loss.detach() / accumulation
            optimizer.step(), optimizer.zero_grad()
        if accelerator.sync_gradients:
            losses.append(accelerator.reduce(running, reduction="mean").item())
            running.zero_()
            if len(losses) == STEPS:
                break
    return training.unwrap_model(model), losses


def assert_same_parameters(model, reference, atol: float = 1e-5) -> None:
    expected_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        value = tp_local(param.detach())  # FSDP2 (native) gathers the tp-local value; a generic tp DTensor the whole
        expected = expected_params[name].detach()
        if not is_generic(model):
            expected = expected_shard(model, name, expected)
        torch.testing.assert_close(value, expected, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def parameters_differ(model, reference, atol: float = 1e-4) -> bool:
    try:
        assert_same_parameters(model, reference, atol=atol)
    except AssertionError:
        return True
    return False


# ---------------------------------------------------------------------------------------------------- the world
def _case(label, load, reference_class, path, rows, *, parallel, batch, accumulation=1, zero_stage=0, average=True):
    dp = parallel.get("data_parallel_size", 1)
    model = load(path, parallel=om.ParallelConfig(**parallel)).train()
    model, logged = prepared_steps(model, rows, batch=batch, accumulation=accumulation, zero_stage=zero_stage,
                                   average=average)
    reference, expected = reference_steps(reference_class.from_pretrained(path).train(), rows,
                                          batch * dp * accumulation)
    if not average:  # the negative control: DDP's per-replica mean trains on other gradients
        assert parameters_differ(model, reference), f"{label}: the per-replica mean matched the global batch's"
        return
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{label} logged losses: {m}")
    assert_same_parameters(model, reference)


def _native_load(cls):
    return lambda path, parallel: cls.from_pretrained(path, parallel=parallel, progress=False)


def _world(paths: dict) -> None:
    llama_vocab = decoders.tiny_config("llama").vocab_size
    bert_vocab = tiny_bert_config().vocab_size
    sft, mlm = sft_rows(llama_vocab, 48), mlm_rows(bert_vocab, 48)
    bert, llama = _native_load(om.BertForMaskedLM), _native_load(om.LlamaForCausalLM)
    # native masked LM at dp 4 with gradient accumulation 2; then the per-replica mean as the negative control
    for average in (True, False):
        _case("bert dp4 ga2", bert, transformers.BertForMaskedLM, paths["bert"], mlm, average=average,
              parallel=dict(data_parallel_size=4), batch=2, accumulation=2)
    _case("llama tp2 dp2 zero3", llama, transformers.LlamaForCausalLM, paths["llama"], sft,
          parallel=dict(tensor_parallel_size=2, data_parallel_size=2), batch=4, zero_stage=3)
    _case("llama pp2 dp2", llama, transformers.LlamaForCausalLM, paths["llama"], sft,
          parallel=dict(pipeline_parallel_size=2, data_parallel_size=2, num_microbatches=2,
                        pipeline_schedule="1f1b"), batch=4)
    # a plain DataLoader of whole sequences at cp > 1: prepare's loader splits and shifts them
    _case("llama cp2 dp2", llama, transformers.LlamaForCausalLM, paths["llama"], sft,
          parallel=dict(context_parallel_size=2, data_parallel_size=2), batch=4)
    generic_mlm = generic_models.auto_class("megatron-bert", om)
    _case("generic megatron-bert dp4 ga2", generic_mlm.from_pretrained, transformers.MegatronBertForMaskedLM,
          paths["megatron-bert"], mlm_rows(101, 48), parallel=dict(data_parallel_size=4), batch=2, accumulation=2)
    _case("generic granite tp2 dp2 zero3", om.AutoModelForCausalLM.from_pretrained, transformers.GraniteForCausalLM,
          paths["granite"], sft_rows(101, 48), parallel=dict(tensor_parallel_size=2, data_parallel_size=2), batch=4,
          zero_stage=3)
    _trainer_case(paths["llama"], sft)


def _trainer_case(path: str, rows: list[dict]) -> None:
    """``om.training.Trainer`` at tp 2 x dp 2 with gradient accumulation 2 (its own ``num_items_in_batch``)."""
    import tempfile

    model = om.LlamaForCausalLM.from_pretrained(path, progress=False, parallel=om.ParallelConfig(
        tensor_parallel_size=2, data_parallel_size=2)).train()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
            learning_rate=ADAMW["lr"], weight_decay=ADAMW["weight_decay"], adam_epsilon=ADAMW["eps"],
            lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to="none", use_cpu=True,
            disable_tqdm=True, seed=0, train_sampling_strategy="sequential", optim="adamw_torch", save_strategy="no")
        trainer = training.Trainer(model=model, args=args, train_dataset=rows, data_collator=_collate)
        trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    # Trainer's AdamW leaves biases and norms undecayed: the reference groups them the same way
    reference = transformers.LlamaForCausalLM.from_pretrained(path).train()
    decay = transformers.Trainer.get_decay_parameter_names(None, reference)
    groups = [dict(params=[p for n, p in reference.named_parameters() if n in decay]),
              dict(params=[p for n, p in reference.named_parameters() if n not in decay], weight_decay=0.0)]
    optimizer = torch.optim.AdamW(groups, **ADAMW)
    expected, rows_per_step = [], 2 * 2 * 2
    for step in range(STEPS):
        loss = reference(**_collate(rows[step * rows_per_step:(step + 1) * rows_per_step])).loss
        loss.backward()
        optimizer.step(), optimizer.zero_grad()
        expected.append(loss.item())
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    assert_same_parameters(training.unwrap_model(trainer.model), reference)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("global_batch")
    paths = {"llama": decoders.save_tiny(root / "llama", "llama"),
             "bert": save_tiny(root / "bert", transformers.BertForMaskedLM, tiny_bert_config())}
    paths.update(generic_models.save(root, ["megatron-bert", "granite"]))
    return paths


def test_every_layout_trains_on_the_global_batch_loss(checkpoints):
    run_distributed(_world, 4, checkpoints, timeout=600)
