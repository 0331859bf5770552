"""T5 under context parallelism (issue 52): source and target each split into the cp ranks' chunks; the
self-attention (bidirectional in the encoder, causal in the decoder) with the learned relative position bias runs the
gathered-keys core (``parallel_layers/context_parallel/gathered.py``: this rank's queries against the whole
sequence's keys, the bias ``[1, n, s_local, s]`` built from the queries' global positions), the cross-attention over
the encoder output gathered from the chunks (``context_parallel/cross.py``).

One spawned group of 4 gloo processes: ``T5ForConditionalGeneration`` (tiny: 8 buckets, max distance 16, so the
32-token source has distant buckets) at cp 2 x dp 2 in ring and all-to-all mode and at cp 2 x tp 2 (ring), on a batch
with right padding in source and target (rows of unequal label counts): 3 AdamW steps (``train_matches``: loss, this
rank's logits chunk, every gradient including ``relative_attention_bias``, every parameter) equal single-process
``transformers`` at 1e-5. Negative control: the bias built from the chunk-local query positions (``arange(s_local)``,
what a cp rank knows without the mask's global positions) is off. Without ``decoder_input_ids`` under cp: an error;
``context_parallel_mode="hybrid"``: refused before anything is built.
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.models.t5.layers_t5 import T5Attention
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.zoo import tiny_config, tiny_kwargs

PAD, START = tiny_kwargs("t5")["pad_token_id"], tiny_kwargs("t5")["decoder_start_token_id"]


def batch(rows: int = 4, enc: int = 32, dec: int = 16) -> dict:
    """Right padding in the source (rows of 32, 24, 16, 32 tokens) and the target; decoder inputs shifted on the
    whole target."""
    gen = torch.Generator().manual_seed(1)
    lengths = [enc - (row % 3) * 8 for row in range(rows)]
    mask = (torch.arange(enc)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(2, 101, (rows, enc), generator=gen).masked_fill(mask == 0, PAD)
    dec_lengths = [dec - (row % 2) * 5 for row in range(rows)]
    dec_mask = (torch.arange(dec)[None] < torch.tensor(dec_lengths)[:, None]).long()
    labels = torch.randint(2, 101, (rows, dec), generator=gen).masked_fill(dec_mask == 0, -100)
    decoder_ids = torch.cat([torch.full((rows, 1), START), labels[:, :-1]], 1).masked_fill_(
        torch.cat([torch.zeros(rows, 1, dtype=torch.bool), labels[:, :-1] == -100], 1), PAD)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=dec_mask,
                labels=labels)


def _model(path, **layout):
    return om.T5ForConditionalGeneration.from_pretrained(path, parallel=om.ParallelConfig(**layout),
                                                         progress=False).train()


def _reference(path):
    return transformers.T5ForConditionalGeneration.from_pretrained(path).train()


def _worker(path):
    data = batch()
    for name, layout in (("cp2 ring x dp2", dict(context_parallel_size=2, data_parallel_size=2)),
                         ("cp2 all_to_all x dp2", dict(context_parallel_size=2, data_parallel_size=2,
                                                      context_parallel_mode="all_to_all")),
                         ("cp2 ring x tp2", dict(context_parallel_size=2, tensor_parallel_size=2))):
        breadcrumb(name)
        train_matches(_model(path, **layout), _reference(path), data, steps=3, shift_labels=False)
    breadcrumb("negative control: the bias of chunk-local query positions")
    model = _model(path, context_parallel_size=2, data_parallel_size=2)
    local_positions = T5Attention.compute_bias

    def chunk_local(self, query_length, key_length, device=None, past_seen_tokens=0, query_positions=None):
        return local_positions(self, query_length, key_length, device, past_seen_tokens)

    T5Attention.compute_bias = chunk_local
    try:
        with pytest.raises(AssertionError):
            train_matches(model, _reference(path), data, steps=1, shift_labels=False)
    finally:
        T5Attention.compute_bias = local_positions
    with pytest.raises(NotImplementedError, match="hybrid"):
        om.T5ForConditionalGeneration.validate_parallel_config(
            tiny_config("t5"), om.ParallelConfig(context_parallel_size=4, context_parallel_mode="hybrid",
                                                 context_parallel_all_to_all_size=2))
    breadcrumb("refusal: no decoder_input_ids")
    local = {k: v[:, :v.shape[1] // 2] for k, v in data.items() if k != "decoder_input_ids"}
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(**local)


@pytest.mark.slow
def test_t5_under_context_parallelism(tmp_path):
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(tiny_config("t5")).save_pretrained(tmp_path / "t5")
    run_distributed(_worker, 4, str(tmp_path / "t5"), timeout=900)
