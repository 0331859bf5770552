"""BART under context parallelism (issue 52): source and target each split into the cp ranks' chunks, the encoder's
bidirectional and the decoder's causal self-attention through the context-parallel core, the cross-attention over
the encoder output gathered from the chunks (``parallel_layers/context_parallel/cross.py``).

One spawned group of 4 gloo processes: ``BartForConditionalGeneration`` (tiny, ``final_logits_bias`` non-zero) at
cp 2 x dp 2 in ring and all-to-all mode, at cp 2 x tp 2 (ring) and at cp 4 hybrid (all-to-all
inside pairs, ring across), on a batch with right padding in the source and
the target (rows of unequal label counts): 3 AdamW steps (``train_matches``: loss, this rank's logits chunk, every
gradient, every parameter) equal single-process ``transformers`` at 1e-5. Negative control: the encoder output
gathered with the rule of a value every rank computes alike (its own chunk of the gradient, not the sum over cp:
``gather_over_context``) gets the encoder's gradients wrong. Without ``decoder_input_ids`` under cp: a clear error.
"""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.bart.modeling_bart import shift_tokens_right

import oslo_models as om
from oslo_models.models.bart import modeling_bart
from oslo_models.models.common.stack.context_parallel import gather_over_context
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.layouts import train_matches
from tests.helpers.zoo import tiny_config, tiny_kwargs

PAD, START = tiny_kwargs("bart")["pad_token_id"], tiny_kwargs("bart")["decoder_start_token_id"]


def batch(rows: int = 4, enc: int = 16, dec: int = 8) -> dict:
    """Right padding in the source (rows of 16, 12, 8, 16 tokens) and the target (the last rows shorter); the decoder
    inputs shifted on the whole target."""
    gen = torch.Generator().manual_seed(1)
    lengths = [enc - (row % 3) * 4 for row in range(rows)]
    mask = (torch.arange(enc)[None] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(3, 101, (rows, enc), generator=gen).masked_fill(mask == 0, PAD)
    dec_lengths = [dec - (row % 2) * 3 for row in range(rows)]
    dec_mask = (torch.arange(dec)[None] < torch.tensor(dec_lengths)[:, None]).long()
    labels = torch.randint(3, 101, (rows, dec), generator=gen).masked_fill(dec_mask == 0, -100)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=shift_tokens_right(labels, PAD, START),
                decoder_attention_mask=dec_mask, labels=labels)


def _model(path, **layout):
    return om.BartForConditionalGeneration.from_pretrained(path, parallel=om.ParallelConfig(**layout),
                                                           progress=False).train()


def _reference(path):
    return transformers.BartForConditionalGeneration.from_pretrained(path).train()


def _worker(path):
    data = batch()
    for name, layout in (("cp2 ring x dp2", dict(context_parallel_size=2, data_parallel_size=2)),
                         ("cp2 all_to_all x dp2", dict(context_parallel_size=2, data_parallel_size=2,
                                                      context_parallel_mode="all_to_all")),
                         ("cp2 ring x tp2", dict(context_parallel_size=2, tensor_parallel_size=2)),
                         ("cp4 hybrid (all-to-all 2)", dict(context_parallel_size=4, context_parallel_mode="hybrid",
                                                            context_parallel_all_to_all_size=2))):
        breadcrumb(name)
        train_matches(_model(path, **layout), _reference(path), data, steps=3, shift_labels=False)
    breadcrumb("negative control: the encoder chunks' gradient not summed over cp")
    model = _model(path, context_parallel_size=2, data_parallel_size=2)
    own_chunk = (lambda x, context: gather_over_context(model, x) if context.cp_size > 1 else x)
    original, modeling_bart.gather_encoder_states = modeling_bart.gather_encoder_states, own_chunk
    try:
        with pytest.raises(AssertionError):
            train_matches(model, _reference(path), data, steps=1, shift_labels=False)
    finally:
        modeling_bart.gather_encoder_states = original
    breadcrumb("refusal: no decoder_input_ids")
    model = _model(path, context_parallel_size=2, data_parallel_size=2)
    local = {k: v[:, :v.shape[1] // 2] for k, v in data.items() if k != "decoder_input_ids"}
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(**local)


@pytest.mark.slow
def test_bart_under_context_parallelism(tmp_path):
    torch.manual_seed(0)
    reference = transformers.BartForConditionalGeneration(tiny_config("bart"))
    with torch.no_grad():
        reference.final_logits_bias.normal_()
    reference.save_pretrained(tmp_path / "bart")
    run_distributed(_worker, 4, str(tmp_path / "bart"), timeout=900)
