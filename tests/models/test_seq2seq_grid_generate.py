"""``generate`` of the encoder-decoder families under the grid tensor-parallel modes equals single-process
``transformers``, token for token, on left-padded batches of unequal lengths.

``generate`` runs the encoder on its own (``model.get_encoder()(...)``, outside the model's forward and its grid
boundary), expands its output for beams over the whole batch, passes it back as ``encoder_outputs`` at every step
and reorders the cache with indices into the whole batch; the grid splits every activation over batch blocks.
Before the fix a 2D T5 met a ``[4, s, d]`` encoder output with its ``[2, ...]`` batch block in the first decoder
step (issue 47). Checked here (``parallel_layers/grid_boundary.py``):

- 4 ranks, 2D (tp 4, a 2 x 2 grid, 2 batch blocks): T5 (ReLU, tied and rescaled head), mT5 (gated-GELU, untied
  head) and BART (learned positions with offset 2, a non-zero ``final_logits_bias`` sliced like the grid head's
  vocabulary columns) greedy and with 2 beams (two prompts' beams in each block); T5 with 2 beams x 2 returned
  sequences on 2 prompts (one prompt's beams per block) and sampled; the standalone encoder call and a forward given
  ``encoder_outputs`` (a tuple) against ``transformers``; a batch of 3 prompts is a ``ValueError`` on one rank
  alone (a collective would hang); Llama with 2 beams (the cache reordering is the base class's, decoder-only
  models went through it too).
- 8 ranks (slow): T5 and BART greedy on 4 prompts and with 2 beams on 8 prompts under 2.5D (tp 8, depth 2) and 3D
  (tp 8): the cube's cache holds the attention's batch block, not the stream's. A wrong block only swaps beams of
  one prompt, which changes the tokens only where those beams' histories differ: of the 2/3/4 beams x 4/8 prompts
  cases, 2 beams on 8 prompts is the one this T5 fails with the stream's block (checked by hand). BART's 3 AdamW
  steps at both layouts too (its 2D training is in ``test_bart.py``'s world), and ``BartForCausalLM``'s step with
  cross-attention over a given ``encoder_hidden_states`` (the encoder mask split in the cube's attention layout).
- Switch Transformers and BART's classification / QA heads refuse the grid modes in validation, before any
  process group, with the reason.

Broken on purpose while writing this, each fails the test: the encoder not a boundary of its own (the issue's
failure: a shape error in the first decoder step); a given ``encoder_outputs`` not split (an IndexError building the
cross-attention mask); beam search reordering the local cache with the global indices (IndexError); the 3D cache
reordered by the stream's batch block (other tokens); no up-front batch check (the one-rank refusal hangs); BART's
``final_logits_bias`` sliced from column 0 on every rank (other tokens in the 2D world).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.helpers import decoders
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import assert_steps_match
from tests.helpers.zoo import tiny_config, tiny_kwargs

CLASSES = {"t5": transformers.T5ForConditionalGeneration, "mt5": transformers.MT5ForConditionalGeneration,
           "bart": transformers.BartForConditionalGeneration}
# BART at 25x its default init_std: below ~0.3 its tiny model repeats one token for every prompt
INIT = {"t5": dict(initializer_factor=3.0), "mt5": dict(initializer_factor=3.0), "bart": dict(init_std=0.5)}
GREEDY = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Initialized 3x wider than the default: the default tiny models mostly repeat one token per prompt, which a
    decode step with a wrong cache would repeat too; these produce varied tokens."""
    root = tmp_path_factory.mktemp("seq2seq_grid")
    paths = {}
    for model_type, cls in CLASSES.items():
        torch.manual_seed(0)
        model = cls(tiny_config(model_type, **INIT[model_type]))
        if model_type == "bart":  # zeros in transformers' init: make the bias count (it changes the tokens)
            torch.nn.init.normal_(model.final_logits_bias)
        model.save_pretrained(root / model_type)
        paths[model_type] = str(root / model_type)
    # BART's training parity at 2.5D / 3D on the default init (the wide one above makes logits of ~30)
    torch.manual_seed(0)
    bart = transformers.BartForConditionalGeneration(tiny_config("bart"))
    torch.nn.init.normal_(bart.final_logits_bias)
    bart.save_pretrained(root / "bart_train")
    paths["bart_train"] = str(root / "bart_train")
    torch.manual_seed(0)
    transformers.BartForCausalLM(tiny_config("bart")).save_pretrained(root / "bart_causal")
    paths["bart_causal"] = str(root / "bart_causal")
    paths["llama"] = decoders.save_tiny(root / "llama", "llama")
    return paths


def left_padded(rows: int, seq: int = 8, seed: int = 1, pad: int = tiny_kwargs("t5")["pad_token_id"]):
    """``rows`` prompts of lengths ``seq, seq-2, seq-4, ...`` (cycling, at least 2), padded on the left with
    ``pad``; tokens from 3 up, so no special token of T5 (pad 0, eos 1) or BART (bos 0, pad 1, eos 2) inside."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([max(seq - 2 * (row % 4), 2) for row in range(rows)])
    mask = (torch.arange(seq)[None] >= (seq - lengths)[:, None]).long()
    ids = torch.randint(3, 101, (rows, seq), generator=gen)
    return ids.masked_fill(mask == 0, pad), mask


def _load(path: str, model_type: str, parallel: om.ParallelConfig):
    model = om.AutoModelForSeq2SeqLM.from_pretrained(path, parallel=parallel, progress=False).eval()
    return model, CLASSES[model_type].from_pretrained(path).eval()


def _assert_generates(model, reference, rows: int, **options) -> None:
    ids, mask = left_padded(rows, pad=reference.config.pad_token_id)
    options = {**GREEDY, **options}
    torch.manual_seed(11)  # for the sampled case; every rank draws tp rank 0's tokens (models/generation.py)
    theirs = reference.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(11)
    ours = model.generate(ids, attention_mask=mask, **options)
    assert torch.equal(ours, theirs), f"{options}: {ours.tolist()} != {theirs.tolist()}"
    assert len({tuple(row) for row in ours.tolist()}) > 1  # the prompts lead to different tokens


def _grid_2d_worker(paths: dict) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=4, tensor_parallel_mode="2d")
    for model_type in ("t5", "mt5", "bart"):
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


def _grid_8_worker(paths: dict) -> None:
    for layout in (dict(tensor_parallel_mode="2.5d", tensor_parallel_depth=2), dict(tensor_parallel_mode="3d")):
        parallel = om.ParallelConfig(tensor_parallel_size=8, **layout)
        for model_type in ("t5", "bart"):
            model, reference = _load(paths[model_type], model_type, parallel)
            _assert_generates(model, reference, 4)
            _assert_generates(model, reference, 8, num_beams=2)
        # BART trains on the grid too: loss, logits, every gradient and the parameters after 3 AdamW steps, on an
        # 8-row batch (the grid's 8 batch blocks) with padding in encoder and decoder (labels -100)
        model = om.BartForConditionalGeneration.from_pretrained(paths["bart_train"], parallel=parallel,
                                                                progress=False).train()
        reference = transformers.BartForConditionalGeneration.from_pretrained(paths["bart_train"]).train()
        ids, mask = left_padded(8, pad=reference.config.pad_token_id)
        labels = torch.randint(3, 101, (8, 4), generator=torch.Generator().manual_seed(3))
        labels[1::3, 2:] = -100
        assert_steps_match(model, reference, dict(input_ids=ids, attention_mask=mask), labels)
        # its decoder alone with cross-attention: under 3D the encoder mask is split in the attention's layout
        model = om.BartForCausalLM.from_pretrained(paths["bart_causal"], parallel=parallel, progress=False).train()
        reference = transformers.BartForCausalLM.from_pretrained(paths["bart_causal"]).train()
        states = torch.randn(8, 6, 32, generator=torch.Generator().manual_seed(4))
        inputs = dict(input_ids=ids, attention_mask=mask, encoder_hidden_states=states,
                      encoder_attention_mask=mask[:, 2:])
        assert_steps_match(model, reference, inputs, ids.masked_fill(mask == 0, -100), steps=1)


@pytest.mark.slow
def test_grid_2p5d_and_3d_generate_match_transformers(checkpoints):
    run_distributed(_grid_8_worker, 8, checkpoints)


@pytest.mark.parametrize("model_type,cls,reason", [
    ("bart", om.BartForSequenceClassification, "replicated head reads whole decoder states"),
    ("bart", om.BartForQuestionAnswering, "replicated head reads whole decoder states"),
    ("switch_transformers", om.SwitchTransformersForConditionalGeneration, "mixture-of-experts"),
])
def test_families_without_grid_modes_refuse_them(model_type, cls, reason):
    for layout in (dict(tensor_parallel_size=4, tensor_parallel_mode="2d"),
                   dict(tensor_parallel_size=8, tensor_parallel_mode="2.5d", tensor_parallel_depth=2)):
        with pytest.raises(NotImplementedError, match=reason):
            cls.validate_parallel_config(tiny_config(model_type), om.ParallelConfig(**layout))
