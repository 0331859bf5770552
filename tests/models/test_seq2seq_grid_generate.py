"""``generate`` of the encoder-decoder families under the grid tensor-parallel modes equals single-process
``transformers``, token for token, on left-padded batches of unequal lengths.

``generate`` runs the encoder on its own (``model.get_encoder()(...)``, outside the model's forward and its grid
boundary), expands its output for beams over the whole batch, passes it back as ``encoder_outputs`` at every step
and reorders the cache with indices into the whole batch; the grid splits every activation over batch blocks.
Before the fix a 2D T5 met a ``[4, s, d]`` encoder output with its ``[2, ...]`` batch block in the first decoder
step (issue 47). Checked here (``parallel_layers/grid_boundary.py``):

- 4 ranks, 2D (tp 4, a 2 x 2 grid, 2 batch blocks): T5 (ReLU, tied and rescaled head) and mT5 (gated-GELU, untied
  head) greedy and with 2 beams (two prompts' beams in each block); T5 with 2 beams x 2 returned sequences on 2
  prompts (one prompt's beams per block) and sampled; the standalone encoder call and a forward given
  ``encoder_outputs`` (a tuple) against ``transformers``; a batch of 3 prompts is a ``ValueError`` on one rank
  alone (a collective would hang); Llama with 2 beams (the cache reordering is the base class's, decoder-only
  models went through it too).
- 8 ranks (slow): T5 greedy on 4 prompts and with 2 beams on 8 prompts under 2.5D (tp 8, depth 2) and 3D (tp 8):
  the cube's cache holds the attention's batch block, not the stream's. A wrong block only swaps beams of one
  prompt, which changes the tokens only where those beams' histories differ: of the 2/3/4 beams x 4/8 prompts
  cases, 2 beams on 8 prompts is the one this T5 fails with the stream's block (checked by hand).
- BART and Switch Transformers refuse the grid modes in validation, before any process group, with the reason.

Broken on purpose while writing this, each fails the test: the encoder not a boundary of its own (the issue's
failure: a shape error in the first decoder step); a given ``encoder_outputs`` not split (an IndexError building the
cross-attention mask); beam search reordering the local cache with the global indices (IndexError); the 3D cache
reordered by the stream's batch block (other tokens); no up-front batch check (the one-rank refusal hangs).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.zoo import tiny_config, tiny_kwargs

CLASSES = {"t5": transformers.T5ForConditionalGeneration, "mt5": transformers.MT5ForConditionalGeneration}
GREEDY = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Initialized 3x wider than the default: the default tiny models mostly repeat one token per prompt, which a
    decode step with a wrong cache would repeat too; these produce varied tokens."""
    root = tmp_path_factory.mktemp("seq2seq_grid")
    paths = {}
    for model_type, cls in CLASSES.items():
        torch.manual_seed(0)
        cls(tiny_config(model_type, initializer_factor=3.0)).save_pretrained(root / model_type)
        paths[model_type] = str(root / model_type)
    paths["llama"] = decoders.save_tiny(root / "llama", "llama")
    return paths


def left_padded(rows: int, seq: int = 8, seed: int = 1):
    """``rows`` prompts of lengths ``seq, seq-2, seq-4, ...`` (cycling, at least 2), padded on the left."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max(seq - 2 * (row % 4), 2) for row in range(rows)])
    mask = (torch.arange(seq)[None] >= (seq - lengths)[:, None]).long()
    ids = torch.randint(3, 101, (rows, seq), generator=gen)  # no pad (0) or eos (1) inside
    return ids.masked_fill(mask == 0, tiny_kwargs("t5")["pad_token_id"]), mask


def _load(path: str, model_type: str, parallel: om.ParallelConfig):
    model = om.AutoModelForSeq2SeqLM.from_pretrained(path, parallel=parallel, progress=False).eval()
    return model, CLASSES[model_type].from_pretrained(path).eval()


def _assert_generates(model, reference, rows: int, **options) -> None:
    ids, mask = left_padded(rows)
    options = {**GREEDY, **options}
    torch.manual_seed(11)  # for the sampled case; every rank draws tp rank 0's tokens (models/generation.py)
    theirs = reference.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(11)
    ours = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(ours, theirs), f"{options}: {ours.tolist()} != {theirs.tolist()}"
    assert len({tuple(row) for row in ours.tolist()}) > 1  # the prompts lead to different tokens


def _grid_2d_worker(paths: dict) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d")
    for model_type in ("t5", "mt5"):
        model, reference = _load(paths[model_type], model_type, parallel)
        _assert_generates(model, reference, 4)
        _assert_generates(model, reference, 4, num_beams=2)
        if model_type != "t5":
            continue
        _assert_generates(model, reference, 2, num_beams=2, num_return_sequences=2)
        _assert_generates(model, reference, 4, do_sample=True, top_k=20, temperature=0.8)

        # the encoder called on its own takes and gives the whole batch; a forward given its output (a tuple, as
        # return_dict=False returns it) splits it. Tolerance 1e-5 of the largest value: the 3x init makes hidden
        # states up to ~10 and logits up to ~30, and the grid's sums in another order are float noise at that scale
        # (a wrong row or block is off by O(1))
        ids, mask = left_padded(4)
        decoder_ids = torch.randint(2, 101, (4, 3), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            hidden = model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            expected = reference.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
            close = lambda a, b: torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5)
            close(hidden, expected)
            got = model(encoder_outputs=(hidden,), attention_mask=mask, decoder_input_ids=decoder_ids)
            want = reference(encoder_outputs=(expected,), attention_mask=mask, decoder_input_ids=decoder_ids)
            close(got.logits, want.logits)
            close(got.encoder_last_hidden_state, hidden)

        # a batch the grid cannot split: refused before any collective, so one rank alone gets the error (a rank
        # that entered a collective here would wait for the others forever and the test would time out)
        if dist.get_rank() == 0:
            ids, mask = left_padded(3)
            with pytest.raises(ValueError, match="batch of 3 prompts, which the tensor-parallel grid cannot split"):
                model.generate(ids, attention_mask=mask, **GREEDY)
        dist.barrier()

    # the cache reordering is the base class's: a decoder-only model's beams went through the same global indices
    model = om.AutoModelForCausalLM.from_pretrained(paths["llama"], parallel=parallel, progress=False).eval()
    reference = transformers.LlamaForCausalLM.from_pretrained(paths["llama"]).eval()
    _assert_generates(model, reference, 4, num_beams=2, pad_token_id=0)


def test_grid_2d_generate_matches_transformers(checkpoints):
    run_distributed(_grid_2d_worker, 4, checkpoints)


def _grid_8_worker(path: str) -> None:
    for layout in (dict(tensor_parallel_mode="2.5d", tensor_parallel_depth=2), dict(tensor_parallel_mode="3d")):
        model, reference = _load(path, "t5", om.ParallelConfig(tensor_parallel_size=8, **layout))
        _assert_generates(model, reference, 4)
        _assert_generates(model, reference, 8, num_beams=2)


@pytest.mark.slow
def test_grid_2p5d_and_3d_generate_match_transformers(checkpoints):
    run_distributed(_grid_8_worker, 8, checkpoints["t5"])


@pytest.mark.parametrize("model_type,cls,reason", [
    ("bart", om.BartForConditionalGeneration, "final_logits_bias is added to 1D vocab-split logits"),
    ("switch_transformers", om.SwitchTransformersForConditionalGeneration, "mixture-of-experts"),
])
def test_families_without_grid_modes_refuse_them(model_type, cls, reason):
    for layout in (dict(tensor_parallel_size=4, tensor_parallel_mode="2d"),
                   dict(tensor_parallel_size=8, tensor_parallel_mode="2.5d", tensor_parallel_depth=2)):
        with pytest.raises(NotImplementedError, match=reason):
            cls.validate_parallel_config(tiny_config(model_type), om.ParallelConfig(**layout))
