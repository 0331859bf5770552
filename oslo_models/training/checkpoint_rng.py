"""The RNG streams a training checkpoint keeps per rank (``rng/rank<k>.pt``): torch, CUDA, numpy, Python and the
tensor-parallel RNG tracker; restored only at the same layout (a rank of another layout has another role)."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state(context) -> dict:
    numpy_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "tp": context.rng.state_dict(), "python": random.getstate(),
             "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict, context) -> None:
    torch.set_rng_state(state["torch"])
    context.rng.load_state_dict(state["tp"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
