"""The column-parallel linears reading one tensor share its entry into the tensor-parallel region
(``SequenceParallelRegion.enter_tensor_parallel``): a Llama block all-gathers its attention input and its MLP input
once each under sequence parallelism (q, k, v and gate, up read them) and reduce-scatters each input gradient once;
without sequence parallelism it all-reduces each input gradient once. Counted per block as the difference between
a 2-layer and a 1-layer model, so the embedding and the head do not enter the figure. Parity of these layouts with
``transformers`` is the zoo's test (tests/models/test_zoo.py)."""
from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import oslo_models as om
from tests.helpers.decoders import save_tiny
from tests.helpers.dist import run_distributed


class _CountCollectives(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.calls[name.split(".")[1].rstrip("_").removeprefix("_")] += 1
        return func(*args, **(kwargs or {}))


def _collectives(path: str, sequence_parallel: bool) -> Counter:
    config = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=sequence_parallel)
    model = om.LlamaForCausalLM.from_pretrained(path, parallel=config).train()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    with _CountCollectives() as counter:
        model(ids, labels=ids).loss.backward()
    return counter.calls


def _per_block(root: str) -> None:
    # sp: forward, the attention and MLP inputs all-gathered once each, o_proj's and down_proj's outputs
    # reduce-scattered; backward, the mirror (one reduce-scatter per gathered input, one all-gather per scattered
    # output), and the gradients of the replicated parameters that saw 1/tp of the tokens summed (the two norms'
    # weights, o_proj's and down_proj's biases: the tiny Llama has biases). Before the sharing: 7 all-gathers and 7
    # reduce-scatters (q, k, v, gate and up each gathered their input).
    # no sp: o_proj and down_proj all-reduced forward, one all-reduce per entered input backward.
    for sequence_parallel, expected in ((True, {"allgather": 4, "reduce_scatter_base": 4, "allreduce": 4}),
                                        (False, {"allreduce": 4})):
        one = _collectives(f"{root}/one", sequence_parallel)
        two = _collectives(f"{root}/two", sequence_parallel)
        per_block = {op: two[op] - one[op] for op in two if two[op] != one[op]}
        assert per_block == expected, (sequence_parallel, per_block, dict(two))


def test_a_block_enters_each_input_once(tmp_path):
    save_tiny(tmp_path / "one", "llama", num_hidden_layers=1)
    save_tiny(tmp_path / "two", "llama", num_hidden_layers=2)
    run_distributed(_per_block, 2, str(tmp_path))
