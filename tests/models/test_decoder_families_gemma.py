"""Gemma 1/2/3 (text) and OLMo 2 beyond the zoo (``tests/models/test_zoo.py`` runs their causal LMs at tp 1, tp 2 +
sequence parallelism, a cached decode loop and pp 2): what the zoo does not cover, against single-process
``transformers`` built from the same weights (fp32, atol 1e-5).

- tp=1, in this process: the other heads (sequence / token classification); greedy ``generate`` with left padding
  token for token (Gemma 2/3: the sliding-window cache, the caps); ``save_pretrained`` of trained weights loads in
  plain ``transformers`` with the same logits; Gemma's embedding scale rounded as ``transformers`` rounds it (bf16);
  activation checkpointing (Gemma 2); soft-capping under context parallelism validates (its parity test is elsewhere).
- Negative controls, one per new piece: each family particular switched off on our model (the norm formula, the
  embedding scale, the attention and final soft caps, the query scale, the window, the second rotary base) no longer
  matches, which also shows the tiny configs exercise it; OLMo 2's norms registered as pre-norms (same keys) do not
  match ``transformers``' layer while the sandwich layer does.
- One spawned group of 2 ranks: tp=2 + sequence parallelism (greedy ``generate`` with left padding, a gathered save
  that plain ``transformers`` loads, the loss-only head with a final soft-cap, and the negative control of a cap that
  turns the vocab padding into ``-cap``), then cp=2 ring and all-to-all (Gemma 3's windows and two rotary bases,
  OLMo 2's full-width norms): loss, this rank's logits and every gradient.
"""
from __future__ import annotations

import pytest
import torch

import oslo_models as om
from oslo_models.data import ContextParallelSplitter
from oslo_models.models.common import RMSNorm
from oslo_models.models.common.loss.lm_loss import causal_token_loss
from oslo_models.models.common.stack.stack import TransformerStack
from oslo_models.models.registry import family_record
from oslo_models.parallel_layers.context_parallel import split_sequence
from tests.helpers.checkpointing import enable_checkpointing
from tests.helpers.dist import run_distributed
from tests.helpers.models import assert_grads_match, padded_batch
from tests.helpers.zoo import tiny_config

TYPES = ("gemma", "gemma2", "gemma3_text", "olmo2")
ATOL = dict(atol=1e-5, rtol=1e-5)
PROMPT = torch.tensor([[5, 17, 42, 3, 9, 11], [0, 0, 8, 21, 33, 4]])  # second row left-padded
PROMPT_MASK = (torch.arange(6) >= torch.tensor([[0], [2]])).long()
GREEDY = dict(attention_mask=PROMPT_MASK, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)


def _class(model_type: str, task: str = "causal_lm") -> type:
    return family_record(model_type).model_class(task)


def _pair(model_type: str, task: str = "causal_lm", *, seed: int = 0, parallel=None, **overrides):
    """(ours via ``from_config``, ``transformers``' twin) from the same seed, each with its own config object."""
    cls = _class(model_type, task)
    torch.manual_seed(seed)
    reference = cls.hf_twin(tiny_config(model_type, **overrides))
    torch.manual_seed(seed)
    return cls.from_config(tiny_config(model_type, **overrides), parallel=parallel), reference


def _save(model_type: str, folder, *, seed: int = 0) -> str:
    torch.manual_seed(seed)
    reference = _class(model_type).hf_twin(tiny_config(model_type))
    with torch.no_grad():  # Gemma's norms start at zero (weight 1 + 0): give every parameter a value of its own
        for param in reference.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    reference.save_pretrained(folder)
    return str(folder)


def _logits_close(got, expected) -> bool:
    return torch.allclose(got, expected, **ATOL)


# ------------------------------------------------------------------ tp=1: heads, generate, save, checkpointing
HEAD_CASES = [(t, task) for t in TYPES for task in family_record(t).classes
              if task in ("sequence_classification", "token_classification")]


@pytest.mark.parametrize("model_type,task", HEAD_CASES, ids=[f"{t}-{k}" for t, k in HEAD_CASES])
def test_classification_heads_match_transformers(model_type, task):
    model, reference = _pair(model_type, task, num_labels=3)
    assert type(model).__name__ == type(reference).__name__
    assert list(model.state_dict()) == list(reference.state_dict())
    model.eval(), reference.eval()  # the token head's dropout
    ids, mask, labels = padded_batch(reference.config.vocab_size)
    labels = torch.tensor([0, 2, 1]) if task == "sequence_classification" else labels.clamp(max=2)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels)
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits, **ATOL)
    torch.testing.assert_close(got.loss, expected.loss, **ATOL)
    expected.loss.backward(), got.loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


@pytest.mark.parametrize("model_type", TYPES)
def test_greedy_generate_with_left_padding_matches_transformers(model_type):
    model, reference = _pair(model_type)
    model.eval(), reference.eval()
    ours, theirs = model.generate(PROMPT, **GREEDY), reference.generate(PROMPT, **GREEDY)
    assert ours.shape == (2, 16) and torch.equal(ours, theirs), (ours, theirs)


@pytest.mark.parametrize("model_type", TYPES)
def test_save_pretrained_loads_in_plain_transformers(model_type, tmp_path):
    source = _save(model_type, tmp_path / "source")
    model = _class(model_type).from_pretrained(source, progress=False)
    model.save_pretrained(tmp_path / "saved")
    reference = _class(model_type).hf_twin.from_pretrained(tmp_path / "saved")
    assert type(reference).__name__ == type(model).__name__
    ids, mask, _ = padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=mask).logits,
                                   reference(ids, attention_mask=mask).logits, **ATOL)


def test_embedding_scale_is_rounded_to_the_embedding_dtype_as_transformers():
    """bf16 with hidden 48: sqrt(48) = 6.928... rounds to 6.9375 in bf16 before the product, as ``transformers``'
    ``GemmaTextScaledWordEmbedding`` does; scaling by the fp32 factor gives other bf16 values (the control)."""
    model, reference = _pair("gemma", hidden_size=48)
    model.to(torch.bfloat16), reference.to(torch.bfloat16)
    ids = torch.arange(3, 101)[None]
    expected = reference.model.embed_tokens(ids)
    assert torch.equal(model.model.embed(ids, None, None), expected)
    assert not torch.equal(model.model.embed_tokens(ids) * 48 ** 0.5, expected)


def test_bf16_load_keeps_both_rotary_bases_fp32_like_transformers(tmp_path):
    """Gemma 3's two frequency sets (in no checkpoint) are recomputed in fp32 after the meta build, so bf16 logits
    equal ``transformers``' bf16 logits exactly."""
    path = _save("gemma3_text", tmp_path / "gemma3")
    model = _class("gemma3_text").from_pretrained(path, dtype=torch.bfloat16, progress=False)
    reference = _class("gemma3_text").hf_twin.from_pretrained(path, dtype=torch.bfloat16)
    for kind in ("sliding_attention", "full_attention"):
        ours, theirs = (getattr(m.model.rotary_emb, f"{kind}_inv_freq") for m in (model, reference))
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    ids = torch.randint(1, 101, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)


def test_activation_checkpointing_gives_transformers_gradients():
    model, reference = _pair("gemma2")
    model.train(), reference.train()
    enable_checkpointing(model)
    ids, mask, labels = padded_batch(reference.config.vocab_size)
    reference(ids, attention_mask=mask, labels=labels).loss.backward()
    model(ids, attention_mask=mask, labels=labels).loss.backward()
    assert assert_grads_match(model, reference) == len(list(model.parameters()))


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_attention_softcap_allowed_under_context_parallelism(model_type):
    """The context-parallel cores cap inside each block (parity: tests/parallel_layers/
    test_context_parallel_softcap.py): a cap no longer refuses cp."""
    parallel = om.ParallelConfig(context_parallel_size=2)
    _class(model_type).validate_parallel_config(tiny_config(model_type, attn_logit_softcapping=0.5), parallel)
    _class(model_type).validate_parallel_config(tiny_config(model_type), parallel)


@pytest.mark.parametrize("model_type", TYPES)
def test_heads_that_do_not_split_are_a_value_error(model_type):
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible by tensor_parallel_size=3"):
        _class(model_type).validate_parallel_config(tiny_config(model_type), om.ParallelConfig(tensor_parallel_size=3))


def test_bidirectional_gemma_is_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        _class("gemma3_text").from_config(tiny_config("gemma3_text", use_bidirectional_attention=True))


# ------------------------------------------------------------------ negative controls
def _other_rotary_base(model):
    """Gemma 3 with the global rotary pair handed to every layer (one base, as a plain rotary module gives)."""
    rotary = model.model.rotary_emb

    class OneBase(type(rotary)):
        def forward(self, x, position_ids):
            pairs = super().forward(x, position_ids)
            return {kind: pairs["full_attention"] for kind in pairs}

    rotary.__class__ = OneBase


def _set_all(model, kind, **values):
    for module in model.modules():
        if isinstance(module, kind):
            for name, value in values.items():
                setattr(module, name, value)


SWITCHES = {  # (model type, what is switched off on our model)
    "gemma-norm_formula": ("gemma", lambda m: _set_all(m, RMSNorm, formula="llama")),
    "gemma-embedding_scale": ("gemma", lambda m: setattr(m.model, "embed", TransformerStack.embed.__get__(m.model))),
    "gemma2-attn_softcap": ("gemma2", lambda m: [setattr(layer.self_attn, "softcap", None)
                                                 for layer in m.model.layers]),
    "gemma2-final_softcap": ("gemma2", lambda m: setattr(m.config, "final_logit_softcapping", None)),
    "gemma2-query_scale": ("gemma2", lambda m: [setattr(layer.self_attn, "scaling", 16 ** -0.5)
                                                for layer in m.model.layers]),
    "gemma2-sliding_window": ("gemma2", lambda m: setattr(m.config, "sliding_window", 64)),
    "gemma3-rotary_bases": ("gemma3_text", _other_rotary_base),
    "gemma3-final_softcap": ("gemma3_text", lambda m: setattr(m.config, "final_logit_softcapping", None)),
    "gemma3-qk_norm_formula": ("gemma3_text", lambda m: [_set_all(layer.self_attn, RMSNorm, formula="llama")
                                                         for layer in m.model.layers]),
}


@pytest.mark.parametrize("switch", list(SWITCHES))
def test_switching_a_particular_off_breaks_parity(switch):
    """Each particular is live in the tiny config and our model needs it: with it off the logits differ."""
    model_type, switch_off = SWITCHES[switch]
    model, reference = _pair(model_type)
    with torch.no_grad():  # the zero-initialized (1 + w) norms: make the formula matter
        for (name, param), (_, ref_param) in zip(model.named_parameters(), reference.named_parameters()):
            if "norm" in name:
                noise = torch.randn_like(param) * 0.3
                param.add_(noise), ref_param.add_(noise)
    ids, mask, _ = padded_batch(reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, expected, **ATOL)
        switch_off(model)
        assert not _logits_close(model(ids, attention_mask=mask).logits, expected), switch


def test_olmo2_post_norms_are_not_pre_norms():
    """The sandwich layer with only post norms equals ``Olmo2DecoderLayer``; the same modules and keys as pre-norms
    (Llama's pre-norm layer under OLMo 2's names) do not (negative control)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2DecoderLayer as HFLayer
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RotaryEmbedding

    from oslo_models.models.llama.modeling_llama import LlamaDecoderLayer
    from oslo_models.models.olmo2 import modeling_olmo2 as olmo2

    class AsPreNorms(LlamaDecoderLayer):
        names = dict(attn_norm="post_attention_layernorm", attn="self_attn", mlp_norm="post_feedforward_layernorm",
                     mlp="mlp")

    config = tiny_config("olmo2")
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = HFLayer(config, 0)
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.3)
    options = olmo2.Olmo2PreTrainedModel.decoder_options(config)
    x = torch.randn(2, 5, config.hidden_size)
    positions = Olmo2RotaryEmbedding(config)(x, torch.arange(5)[None])
    mask = torch.full((5, 5), torch.finfo(torch.float32).min).triu(1)[None, None]
    expected = theirs(x, attention_mask=mask, position_embeddings=positions)
    for layer_class, matches in ((olmo2.Olmo2DecoderLayer, True), (AsPreNorms, False)):
        ours = layer_class(config, 0, options=options, attention_type="full_attention",
                           mlp=olmo2.Olmo2PreTrainedModel.build_mlp(config, 0))
        assert list(ours.state_dict()) == list(theirs.state_dict())
        ours.load_state_dict(theirs.state_dict())
        got = ours(x, mask, positions, None)
        assert _logits_close(got, expected) is matches, layer_class.__name__


# ------------------------------------------------------------------ one spawned group: tp=2 + SP, then cp=2
def _tp2(paths: dict, root: str) -> None:
    parallel = om.ParallelConfig(tensor_parallel_size=2, sequence_parallel=True)
    ids, mask, labels = padded_batch(101, seq=8)
    for model_type, path in paths.items():
        model = _class(model_type).from_pretrained(path, parallel=parallel, progress=False)
        reference = _class(model_type).hf_twin.from_pretrained(path)
        # greedy generate with left padding, the sliding-window cache of Gemma 2/3 included
        ours, theirs = model.generate(PROMPT, **GREEDY), reference.generate(PROMPT, **GREEDY)
        assert torch.equal(ours, theirs), (model_type, ours, theirs)
        # the gathered save loads in plain transformers (OLMo 2's full-width norms are split over the ranks)
        model.save_pretrained(f"{root}/{model_type}")
        reloaded = _class(model_type).hf_twin.from_pretrained(f"{root}/{model_type}")
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids, attention_mask=mask).logits,
                                       reference(ids, attention_mask=mask).logits, **ATOL)
        if getattr(reference.config, "final_logit_softcapping", None) is None:
            continue
        # the loss-only head with a final cap: the loss of transformers (the fused kernel, which has no cap, is
        # bypassed for the local logits); vocab 101 at tp=2 pads one column on rank 1
        model.train(), reference.train()
        expected = reference(ids, attention_mask=mask, labels=labels).loss
        got = model(ids, attention_mask=mask, labels=labels, skip_logits=True)
        assert got.logits is None
        torch.testing.assert_close(got.loss, expected, **ATOL)
        # negative control: capping the vocab-split logits without keeping the padding at -inf gives it mass
        cap = model.config.final_logit_softcapping
        with torch.no_grad():
            hidden = model.model(ids, attention_mask=mask).last_hidden_state
            local = model.lm_head(hidden)
            naive = causal_token_loss(torch.tanh(local / cap) * cap, labels, model.lm_head)
        assert local.isneginf().any() == (model.parallel_context.tp_rank == 1)
        assert not torch.allclose(naive, expected, **ATOL)


def _cp2(paths: dict) -> None:
    for mode in ("ring", "all_to_all"):
        for model_type in ("gemma3_text", "olmo2"):
            model = _class(model_type).from_pretrained(paths[model_type], progress=False, parallel=om.ParallelConfig(
                context_parallel_size=2, context_parallel_mode=mode)).train()
            om.distributed.mark_gradients_reduced(model, "caller")  # the chunks' gradients are averaged below
            reference = _class(model_type).hf_twin.from_pretrained(paths[model_type]).train()
            ids, mask, labels = padded_batch(101, batch=2, seq=8)
            context = model.parallel_context
            local = ContextParallelSplitter(context, shift_labels=True)(dict(input_ids=ids, attention_mask=mask,
                                                                             labels=labels))
            expected, got = reference(ids, attention_mask=mask, labels=labels), model(**local)
            torch.testing.assert_close(got.loss, expected.loss, **ATOL)
            torch.testing.assert_close(got.logits, split_sequence(expected.logits, context.cp_rank, 2, mode), **ATOL)
            expected.loss.backward(), got.loss.backward()
            for param in model.parameters():  # what data parallelism over dp x cp does: average the chunks' grads
                torch.distributed.all_reduce(param.grad, group=context.cp_group)
                param.grad /= context.cp_size
            assert assert_grads_match(model, reference) == len(list(model.parameters())), (mode, model_type)


def _worker(paths: dict, root: str) -> None:
    _tp2(paths, root)
    _cp2(paths)


def test_tp2_generate_save_softcapped_loss_and_cp2(tmp_path):
    paths = {t: _save(t, tmp_path / t) for t in TYPES}
    run_distributed(_worker, 2, paths, str(tmp_path / "saved"), timeout=600)
