"""The single-process ``transformers`` runs the image-text tests compare against."""
from __future__ import annotations

import torch
import transformers

from oslo_models.image_text import vision_parameter_names
from tests.image_text.batches import make_batch
from tests.image_text.models import build

STEPS = 3
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-5)
TOL = dict(atol=1e-5, rtol=1e-5)


def vision_names(name: str) -> list[str]:
    return vision_parameter_names(build(name))


def reference_run(path: str, name: str, freeze: bool = False, generate: bool = True) -> dict:
    """Plain ``transformers`` from ``path`` on the type's batch: logits before training, greedy tokens, the loss of
    each of ``STEPS`` AdamW steps on the whole batch, the first step's gradients, the state and logits after them.
    ``freeze``: the vision side (``vision_parameter_names``) does not train (and is checked unchanged)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(path).eval()
    batch = make_batch(name, model)
    plain = {k: v for k, v in batch.items() if k != "labels"}
    out = {"batch": batch, "vision": vision_parameter_names(model)}
    with torch.no_grad():
        out["logits"] = model(**plain).logits
    if generate:
        out["generated"] = model.generate(**plain, max_new_tokens=4, do_sample=False, pad_token_id=0)
    params = dict(model.named_parameters())
    before = {n: params[n].detach().clone() for n in out["vision"]}
    if freeze:
        for n in out["vision"]:
            params[n].requires_grad_(False)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)
    losses = []
    for step in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        if step == 0:  # every gradient of the first step (None for a frozen parameter)
            out["grads"] = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
        opt.step(), opt.zero_grad()
        losses.append(loss.detach())
    out["losses"] = losses
    moved = max(float((params[n].detach() - before[n]).abs().max()) for n in out["vision"])
    assert (moved == 0) == freeze, (name, moved)
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out["logits_after"] = model.eval()(**plain).logits
    return out
