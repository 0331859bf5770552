"""Sampling ``generate`` under tensor parallelism with a different seed on every rank (``manual_seed(base + rank)``)
gives the same tokens on every rank, equal to single-process ``transformers`` seeded like tp rank 0, for GPT-2 and
T5 at tp=2; also when rank 0's draw hits EOS early (ranks used to leave the decode loop at different steps and
crash). Rank 0's RNG advances exactly as in ``transformers``; the other ranks get their own RNG state back. A
pipelined model refuses ``generate`` at the call, before any collective."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import save_tiny, tiny_t5_config
from tests.helpers.models import save_tiny_gpt2

BASE_SEED = 100
SAMPLING = dict(do_sample=True, top_k=0, max_new_tokens=10)


def _same_on_every_rank(tensor: torch.Tensor) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor.contiguous())
    for rank, other in enumerate(gathered):
        assert torch.equal(other, tensor), f"rank {rank} generated {other.tolist()}, this rank {tensor.tolist()}"


def _generate_seeded(model, seed: int, inputs: dict, **options):
    torch.manual_seed(seed)
    out = model.generate(**inputs, **SAMPLING, **options)
    return out, torch.get_rng_state()


def _check_family(path: str, hf_cls, auto, inputs: dict, pad_token_id: int) -> None:
    reference = hf_cls.from_pretrained(path).eval()
    model = auto.from_pretrained(path, parallel=om.ParallelConfig(tensor_parallel_size=2), progress=False).eval()
    rank = dist.get_rank()
    expected, expected_state = _generate_seeded(reference, BASE_SEED, inputs, pad_token_id=pad_token_id)
    # EOS hit early by rank 0's draw: the token rank 0 samples third (rank 1's own seed would not pick it there).
    eos = int(expected[0, -SAMPLING["max_new_tokens"] + 2])
    expected_eos, _ = _generate_seeded(reference, BASE_SEED, inputs, eos_token_id=eos, pad_token_id=pad_token_id)
    if expected.shape[0] == 1:
        assert expected_eos.shape[1] < expected.shape[1]  # the reference stops early

    for options, want in ((dict(), expected), (dict(eos_token_id=eos), expected_eos)):
        torch.manual_seed(BASE_SEED + rank)
        before = torch.get_rng_state()
        got = model.generate(**inputs, **SAMPLING, pad_token_id=pad_token_id, **options)
        _same_on_every_rank(got)
        assert torch.equal(got, want), (options, got.tolist(), want.tolist())
        if rank == 0:
            if not options:
                assert torch.equal(torch.get_rng_state(), expected_state)  # advanced as in transformers
        else:
            assert torch.equal(torch.get_rng_state(), before)  # its own stream, untouched


def _worker(gpt2_path: str, t5_path: str) -> None:
    prompt = torch.tensor([[5, 17, 42, 8], [9, 3, 77, 61]])
    _check_family(gpt2_path, transformers.GPT2LMHeadModel, om.AutoModelForCausalLM,
                  dict(input_ids=prompt, attention_mask=torch.ones_like(prompt)), pad_token_id=0)
    _check_family(t5_path, transformers.T5ForConditionalGeneration, om.AutoModelForSeq2SeqLM,
                  dict(input_ids=prompt, attention_mask=torch.ones_like(prompt)), pad_token_id=0)
    # One prompt: ranks that disagreed on EOS used to leave the loop at different steps (a crash or hang).
    _check_family(gpt2_path, transformers.GPT2LMHeadModel, om.AutoModelForCausalLM,
                  dict(input_ids=prompt[:1], attention_mask=torch.ones_like(prompt[:1])), pad_token_id=0)


def _pipeline_worker(gpt2_path: str) -> None:
    cfg = om.ParallelConfig(pipeline_parallel_size=2)
    model = om.AutoModelForCausalLM.from_pretrained(gpt2_path, parallel=cfg, progress=False)
    with pytest.raises(RuntimeError, match="generate\\(\\) cannot run with pipeline_parallel_size=2"):
        model.generate(torch.tensor([[5, 17]]), max_new_tokens=2)
    dist.barrier()  # both ranks got here: nothing was left waiting in a collective


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    return (save_tiny_gpt2(root / "gpt2", n_layer=2),
            save_tiny(root / "t5", transformers.T5ForConditionalGeneration, tiny_t5_config()))


def test_sampling_is_the_same_on_every_tp_rank_whatever_the_seeds(checkpoints):
    run_distributed(_worker, 2, *checkpoints, timeout=180)


def test_generate_refused_at_the_call_when_pipelined(checkpoints):
    run_distributed(_pipeline_worker, 2, checkpoints[0], timeout=120)


def test_generate_on_a_non_generative_head_is_an_attribute_error(checkpoints, tmp_path):
    path = save_tiny_gpt2(tmp_path / "base", cls=transformers.GPT2Model)
    model = om.AutoModel.from_pretrained(path, progress=False)
    with pytest.raises(AttributeError, match="not a generative head"):
        model.generate(torch.tensor([[1, 2]]))
