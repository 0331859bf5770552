"""Tiny models for parity tests: built with ``transformers`` from a fixed seed and saved in Hub format."""
from __future__ import annotations

import torch
import transformers

from tests.helpers import zoo


def tiny_gpt2_config(**overrides) -> transformers.GPT2Config:
    """The zoo's tiny GPT-2 (its record in ``oslo_models/models/gpt2/__init__.py``), with ``overrides``."""
    return zoo.tiny_config("gpt2", **overrides)


def save_tiny_gpt2(path, *, seed: int = 0, cls=transformers.GPT2LMHeadModel, **overrides) -> str:
    torch.manual_seed(seed)
    cls(tiny_gpt2_config(**overrides)).save_pretrained(path)
    return str(path)


def save_seeded(root, builders: dict, classes: dict) -> dict[str, str]:
    """Save ``classes[name](builders[name]())`` under ``root/name`` for each name, each initialized from seed 0."""
    paths = {}
    for name, config in builders.items():
        torch.manual_seed(0)
        classes[name](config()).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def padded_batch(vocab_size: int, batch: int = 3, seq: int = 8, seed: int = 1):
    """Right-padded batch of unequal lengths: ids, attention_mask, labels (-100 on padding)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(1, batch):
        mask[row, seq - 2 * row:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def expected_shard(model, name: str, full: torch.Tensor) -> torch.Tensor:
    """The slice of a full (reference) tensor that parameter ``name`` of ``model`` holds on this rank."""
    spec = model.parallel_plan.shard_spec(model, name)
    # any tensor-parallel mode; the ep axis for stacked experts
    return spec.read_local(tuple(full.shape), lambda index: full[index], model.parallel_context)


def tp_local(tensor: torch.Tensor) -> torch.Tensor:
    """A ZeRO-2/3 (FSDP2) DTensor gathered to the rank's tensor-parallel-local value (collective); else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def assert_grads_match(model, reference, atol: float = 1e-5, rtol: float = 1e-4) -> int:
    """Every local gradient equals the matching slice of the reference gradient; returns how many were checked.

    Tied reference parameters are looked up under every name (``lm_head.weight`` is ``wte.weight``), so a
    pipeline stage's copy of a tied tensor is compared with the whole tied gradient."""
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    checked = 0
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} has no gradient"
        expected = expected_shard(model, name, reference_params[name].grad)
        torch.testing.assert_close(tp_local(param.grad), expected, atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")
        checked += 1
    return checked


def assert_params_match(model, reference, atol: float = 1e-5, rtol: float = 1e-4) -> None:
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        expected = expected_shard(model, name, reference_params[name].detach())
        torch.testing.assert_close(tp_local(param.detach()), expected, atol=atol, rtol=rtol,
                                   msg=lambda m, n=name: f"{n}: {m}")


def adamw_pair(model, reference, *, zero_stage: int = 0, accelerator=None, **adamw):
    """``(wrapped model, its optimizer, reference optimizer)``: AdamW on both; the model made data parallel by
    ``shard_data_parallel``, or by ``om.training.prepare`` when an ``accelerator`` is given (Accelerate's path)."""
    from oslo_models.training import prepare, shard_data_parallel

    ref_opt = torch.optim.AdamW(reference.parameters(), **adamw)
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    if accelerator is None:
        wrapped, opt = shard_data_parallel(model, opt, zero_stage=zero_stage)
    else:
        wrapped, opt = prepare(accelerator, model, opt, zero_stage=zero_stage)
    return wrapped, opt, ref_opt


def assert_gpt2_data_parallel_steps_match(path: str, parallel, global_ids: torch.Tensor, layout: tuple[int, int],
                                          steps: int = 3) -> None:
    """GPT-2 from ``path`` at ``parallel`` wrapped by ``om.data_parallel``, each dp rank training on its slice of
    ``global_ids`` (the same slice within a TP group, disjoint across dp), against plain ``transformers`` on the
    whole batch: the dp-mean loss of every step and the parameters after ``steps`` AdamW steps.
    ``layout``: the expected ``(dp_size, tp_size)``."""
    import transformers

    import oslo_models as om

    reference = transformers.GPT2LMHeadModel.from_pretrained(path).train()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    model = om.AutoModelForCausalLM.from_pretrained(path, parallel=parallel, progress=False).train()
    ctx = model.parallel_context
    assert (ctx.dp_size, ctx.tp_size) == layout
    ddp = om.data_parallel(model, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    local_ids = global_ids.chunk(ctx.dp_size)[ctx.dp_rank]
    for _ in range(steps):
        expected = reference(global_ids, labels=global_ids)
        expected.loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        loss = ddp(local_ids, labels=local_ids).loss
        loss.backward()
        opt.step(), opt.zero_grad()
        mean_loss = loss.detach().clone()
        torch.distributed.all_reduce(mean_loss, group=ctx.dp_group)
        torch.testing.assert_close(mean_loss / ctx.dp_size, expected.loss.detach(), atol=1e-5, rtol=1e-5)
    assert_params_match(model, reference)
