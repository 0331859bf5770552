"""T5 checkpoints and generation under tp=2 with sequence parallelism: a trained Flan-style model (gated FF,
untied head) saves what plain ``transformers`` reloads to the same logits with the source's keys; sliced loading
from a sharded checkpoint gives the same model; greedy ``generate`` (EncoderDecoderCache, one-token decode steps
without SP) gives the tokens ``transformers`` gives for both FF variants; ``T5Model`` / ``T5EncoderModel`` and
seeded init match; sizes that do not divide are ``ValueError``s."""
from __future__ import annotations

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file

import oslo_models as om
from tests.helpers.dist import run_distributed
from tests.helpers.encoders import save_tiny_t5, seq2seq_batch, tiny_t5_config
from tests.helpers.models import assert_params_match


def _keys(folder: str) -> set[str]:
    return {key for name in os.listdir(folder) if name.endswith(".safetensors")
            for key in load_file(os.path.join(folder, name))}


def _checkpoint_worker(root: str) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    inputs, labels = seq2seq_batch()
    relu, gated, single, sharded = (os.path.join(root, name) for name in ("relu", "gated", "single", "sharded"))
    model = om.AutoModelForSeq2SeqLM.from_pretrained(gated, parallel=parallel, progress=False).train()
    model(**inputs, labels=labels).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # trained weights: the reload below is not a no-op
    model.eval()
    logits = model(**inputs, labels=labels).logits
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    again = om.AutoModelForSeq2SeqLM.from_pretrained(sharded, parallel=parallel, progress=False)
    assert again.lm_head.weight is not again.shared.weight
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    if torch.distributed.get_rank() == 0:
        assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
        assert _keys(single) == _keys(sharded) == _keys(gated)
        for folder in (single, sharded):
            plain = transformers.T5ForConditionalGeneration.from_pretrained(folder)
            torch.testing.assert_close(plain(**inputs, labels=labels).logits, logits, atol=1e-5, rtol=1e-5)

    prompt, mask = inputs["input_ids"], inputs["attention_mask"]
    for path in (relu, gated):
        model = om.AutoModelForSeq2SeqLM.from_pretrained(path, parallel=parallel, progress=False)
        reference = transformers.T5ForConditionalGeneration.from_pretrained(path)
        kwargs = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        ours, theirs = model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs)
        assert ours.shape == theirs.shape == (3, 9)
        assert torch.equal(ours, theirs)

    for auto, hf_class in ((om.AutoModel, transformers.T5Model),
                           (om.AutoModelForTextEncoding, transformers.T5EncoderModel)):
        ours = auto.from_pretrained(relu, parallel=parallel, progress=False)
        reference = hf_class.from_pretrained(relu)
        extra = {} if hf_class is transformers.T5EncoderModel else dict(decoder_input_ids=labels.clamp(min=0))
        torch.testing.assert_close(ours(input_ids=prompt, attention_mask=mask, **extra).last_hidden_state,
                                   reference(input_ids=prompt, attention_mask=mask, **extra).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)

    # Negative control: the same numbers with this rank's heads of the position bias swapped must NOT match.
    model = om.AutoModelForSeq2SeqLM.from_pretrained(relu, parallel=parallel, progress=False)
    reference = transformers.T5ForConditionalGeneration.from_pretrained(relu)
    bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    with torch.no_grad():
        bias.copy_(bias.flip(1))
    assert not torch.allclose(model(**inputs, labels=labels).logits, reference(**inputs, labels=labels).logits,
                              atol=1e-3)

    config = tiny_t5_config("gated-gelu", vocab_size=103)
    torch.manual_seed(7)
    reference = transformers.T5ForConditionalGeneration(config)
    torch.manual_seed(7)
    model = om.AutoModelForSeq2SeqLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=2))
    assert_params_match(model, reference, atol=0, rtol=0)


def test_save_load_generate_under_tp2(tmp_path):
    save_tiny_t5(tmp_path / "relu", gated=False)
    save_tiny_t5(tmp_path / "gated", gated=True)
    run_distributed(_checkpoint_worker, 2, str(tmp_path))


@pytest.mark.parametrize("overrides,tp,message", [
    (dict(num_heads=6), 4, "num_heads=6 is not divisible by tensor_parallel_size=4"),
    (dict(d_ff=66), 4, "d_ff=66 is not divisible by tensor_parallel_size=4"),
])
def test_sizes_that_do_not_divide_are_value_errors(overrides, tp, message):
    with pytest.raises(ValueError, match=message):
        om.AutoModelForSeq2SeqLM.from_config(tiny_t5_config(**overrides),
                                             parallel=om.ParallelConfig(tensor_parallel_size=tp))
