"""RNG tracker: dropout streams that are right inside and outside tensor-parallel regions.

Two streams (Megatron-LM's design, without its global tracker):

- the *default* stream: torch's own generator. Replicated regions (dropout on activations every TP rank holds in
  full) must draw the same mask on every TP rank, which they do when the user seeds every rank alike, as with any
  data-parallel job.
- the *tensor-parallel* stream, seeded ``seed + 2718 + 100 * pp_rank + tp_rank``: regions whose activations differ
  per TP rank (attention probabilities of this rank's heads; sequence-parallel slices of the residual stream) draw
  independent masks from it.

``fork()`` swaps the tensor-parallel stream in for the duration of a block, so fused kernels that draw from the
device generator (SDPA's dropout) use it too. With one TP rank the fork is a no-op, which keeps a tp=1 model
bit-identical to the plain ``transformers`` model under the same seed.
"""
from __future__ import annotations

import contextlib

import torch

_TENSOR_PARALLEL_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Holds the tensor-parallel dropout stream of one rank. Owned by a ``ParallelContext``."""

    def __init__(self, seed: int, *, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                 device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.tp_size = tp_size
        self.seed = seed + _TENSOR_PARALLEL_SEED_OFFSET + 100 * pp_rank + tp_rank
        self._state = self._fresh_state(self.seed)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        state = _get_state(self.device)
        _set_state(self.device, saved)
        return state

    @contextlib.contextmanager
    def fork(self, enabled: bool = True):
        """Run the block on the tensor-parallel stream, then restore the default stream."""
        if not enabled or self.tp_size == 1:
            yield
            return
        saved = _get_state(self.device)
        _set_state(self.device, self._state)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(self.device, saved)

    def checkpointed(self, checkpoint_fn):
        """Wrap an activation-checkpoint function (``torch.utils.checkpoint.checkpoint`` or a partial of it) so
        that the recomputation draws the same tensor-parallel dropout masks as the forward did.

        torch's checkpoint restores the default generator for the recomputation (``preserve_rng_state``) but
        knows nothing of this stream, which has moved on by then: without the replay, TP dropout masks in the
        recomputed forward would differ from the ones the forward used, and the gradients would be wrong.
        Works for reentrant and non-reentrant checkpointing (it wraps the function that is run twice).
        """
        tracker = self

        def checkpoint_with_tp_rng(function, *args, **kwargs):
            start = tracker._state.clone()
            runs = [0]

            def replay(*inner_args, **inner_kwargs):
                runs[0] += 1
                if runs[0] == 1:  # the forward
                    return function(*inner_args, **inner_kwargs)
                after = tracker._state
                tracker._state = start.clone()
                try:  # the recomputation: the stream as the forward found it, then back to where it is now
                    return function(*inner_args, **inner_kwargs)
                finally:
                    tracker._state = after

            return checkpoint_fn(replay, *args, **kwargs)

        return checkpoint_with_tp_rng

    def state_dict(self) -> dict:
        return {"seed": self.seed, "state": self._state.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self._state = state["state"].clone()
