"""The ``transformers`` model contract at tp1 and tp2 (± sequence parallelism), against ``transformers`` itself:

- ``output_attentions`` / ``output_hidden_states`` (forward, ``return_dict=False`` tuples, and
  ``generate(return_dict_in_generate=True)``) equal ``transformers``' on every rank (attentions gathered over the
  TP heads, hidden states over the SP chunks);
- ``resize_token_embeddings`` equals ``transformers`` resized the same way from the same seed (new rows drawn from
  the full vocabulary's mean/covariance), and the saved model reloads in plain ``transformers`` with the same logits;
- the heads added for the contract equal their ``transformers`` twins (logits and loss).

fp32, atol 1e-5. One spawned tp2 group runs every family (GPT-2, BERT, RoBERTa, T5, Llama, Qwen2) and layout.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from tests.helpers import zoo
from tests.helpers.decoders import tiny_config
from tests.helpers.dist import run_distributed
from tests.helpers.models import expected_shard, tiny_gpt2_config

ATOL = dict(atol=1e-5, rtol=1e-5)
# The zoo's tiny models (tests/helpers/zoo.py) with this test's own sizes: vocab 99 (odd, and not the zoo's 101),
# BERT / RoBERTa with 512 positions, T5 with transformers' default 32 relative-position buckets up to distance 128.
_BERT = dict(vocab_size=99, max_position_embeddings=512)
_T5 = dict(vocab_size=99, relative_attention_num_buckets=32, relative_attention_max_distance=128)


def _bert(model_type: str = "bert", **overrides):
    return zoo.tiny_config(model_type, **_BERT, **overrides)


def _t5(**overrides):
    return zoo.tiny_config("t5", **_T5, **overrides)


# name -> (transformers class, config, our class name, extra forward inputs: "decoder" = decoder ids)
LM_FAMILIES = {
    "gpt2": (transformers.GPT2LMHeadModel, lambda: tiny_gpt2_config(), "GPT2LMHeadModel", ()),
    "bert": (transformers.BertForMaskedLM, lambda: _bert(), "BertForMaskedLM", ()),
    "roberta": (transformers.RobertaForMaskedLM, lambda: _bert("roberta"), "RobertaForMaskedLM", ()),
    "t5": (transformers.T5ForConditionalGeneration, lambda: _t5(), "T5ForConditionalGeneration", ("decoder",)),
    "t5_untied": (transformers.T5ForConditionalGeneration,
                  lambda: _t5(tie_word_embeddings=False, feed_forward_proj="gated-gelu"),
                  "T5ForConditionalGeneration", ("decoder",)),
    # the Llama-shaped decoders: untied Llama with biases, tied Qwen2 with a sliding window past layer 1
    "llama": (transformers.LlamaForCausalLM, lambda: tiny_config("llama"), "LlamaForCausalLM", ()),
    "qwen2": (transformers.Qwen2ForCausalLM, lambda: tiny_config("qwen2"), "Qwen2ForCausalLM", ()),
}
# (family, new vocabulary size, pad_to_multiple_of, mean_resizing): 99/101 -> an odd size changes the TP padding
RESIZE_CASES = [("gpt2", 121, None, True), ("gpt2", 110, 16, False), ("bert", 121, None, True),
                ("roberta", 121, None, True), ("t5", 121, None, True), ("t5_untied", 110, 16, True),
                ("llama", 121, None, True), ("qwen2", 110, 16, False)]
HEADS = {
    "GPT2ForTokenClassification": (lambda: tiny_gpt2_config(num_labels=3), "token"),
    "GPT2ForQuestionAnswering": (lambda: tiny_gpt2_config(), "span"),
    "BertLMHeadModel": (lambda: _bert(is_decoder=True), "causal"),
    "BertForMultipleChoice": (lambda: _bert(), "choice"),
    "BertForNextSentencePrediction": (lambda: _bert(), "nsp"),
    "RobertaForCausalLM": (lambda: _bert("roberta", is_decoder=True), "causal"),
    "RobertaForMultipleChoice": (lambda: _bert("roberta"), "choice"),
    "T5ForSequenceClassification": (lambda: _t5(num_labels=3), "t5_sequence"),
    "T5ForTokenClassification": (lambda: _t5(num_labels=3), "token"),
    "T5ForQuestionAnswering": (lambda: _t5(num_labels=2), "span"),
}


def _ids(shape, vocab=99, seed=1):
    return torch.randint(2, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _inputs(kind: str, vocab: int) -> dict:
    ids = _ids((2, 8), vocab)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    inputs["attention_mask"][1, 6:] = 0
    if kind == "decoder":
        inputs["decoder_input_ids"] = _ids((2, 8), vocab, seed=2)
    elif kind == "token":
        inputs["labels"] = _ids((2, 8), 3, seed=3).clamp(0, 2)
    elif kind == "span":
        inputs.update(start_positions=torch.tensor([1, 3]), end_positions=torch.tensor([4, 9]))
    elif kind == "causal":
        inputs["labels"] = ids
    elif kind == "choice":
        inputs = {key: value.unsqueeze(1).expand(-1, 3, -1).contiguous() for key, value in inputs.items()}
        inputs["labels"] = torch.tensor([0, 2])
    elif kind == "nsp":
        inputs["labels"] = torch.tensor([0, 1])
    elif kind == "t5_sequence":
        inputs["input_ids"][:, -1] = 1  # <eos>
        inputs["attention_mask"] = torch.ones_like(ids)
        inputs["labels"] = torch.tensor([0, 2])
    return inputs


def assert_outputs_match(got, expected, what: str) -> int:
    """Every tensor of ``expected`` (a ModelOutput or nested tuples) equals ``got``; returns how many."""
    if torch.is_tensor(expected):
        torch.testing.assert_close(got, expected, **ATOL, msg=lambda m: f"{what}: {m}")
        return 1
    if isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(expected), f"{what}: {type(got)} vs {expected}"
        return sum(assert_outputs_match(g, e, f"{what}[{i}]") for i, (g, e) in enumerate(zip(got, expected)))
    if hasattr(expected, "keys"):
        assert list(got.keys()) == list(expected.keys()), f"{what}: {list(got.keys())} != {list(expected.keys())}"
        return sum(assert_outputs_match(got[k], expected[k], f"{what}.{k}") for k in expected.keys()
                   if k != "past_key_values")
    if hasattr(expected, "get_seq_length"):  # a KV cache object: compared through the logits it produced
        return 0
    assert got == expected, what
    return 0


def save_checkpoints(root) -> dict:
    paths = {}
    for name, (hf_class, make_config, _, _) in LM_FAMILIES.items():
        torch.manual_seed(0)
        hf_class(make_config()).save_pretrained(root / name)
        paths[name] = str(root / name)
    for name, (make_config, _) in HEADS.items():
        torch.manual_seed(0)
        getattr(transformers, name)(make_config()).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


def _outputs_check(paths: dict, tp: int) -> None:
    """Attentions and hidden states, dict and tuple, ± SP: equal ``transformers``' on every rank."""
    for name, (hf_class, _, ours, extra) in LM_FAMILIES.items():
        if name == "t5_untied":  # same stacks as "t5"; its untied head is exercised by the resize check
            continue
        reference = hf_class.from_pretrained(paths[name], attn_implementation="eager").eval()
        inputs = _inputs(extra[0] if extra else "", reference.config.vocab_size)
        flags = dict(output_attentions=True, output_hidden_states=True)
        expected = reference(**inputs, **flags)
        assert expected.get("attentions", expected.get("encoder_attentions")), name
        for sp in (False, True) if tp > 1 else (False,):
            model = getattr(om, ours).from_pretrained(
                paths[name], parallel=om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=sp),
                attn_implementation="eager", progress=False)
            got = model(**inputs, **flags)
            assert assert_outputs_match(got, expected, f"{name} tp{tp} sp{sp}") >= 5
            assert_outputs_match(model(**inputs, **flags, return_dict=False),
                                 reference(**inputs, **flags, return_dict=False), f"{name} tuple")
            assert_outputs_match(model(**inputs, output_attentions=True), reference(**inputs, output_attentions=True),
                                 f"{name} attentions only")


def _resize_check(paths: dict, tp: int, save_root) -> None:
    """``resize_token_embeddings`` (odd size: the TP padding changes; and ``pad_to_multiple_of``) equals
    ``transformers`` resized from the same seed; plain ``transformers`` reloads the saved model exactly."""
    for name, new_size, multiple, mean in RESIZE_CASES:
        hf_class, _, ours, extra = LM_FAMILIES[name]
        reference = hf_class.from_pretrained(paths[name]).eval()
        model = getattr(om, ours).from_pretrained(
            paths[name], parallel=om.ParallelConfig(tensor_parallel_size=tp), progress=False)
        torch.manual_seed(7)
        reference.resize_token_embeddings(new_size, pad_to_multiple_of=multiple, mean_resizing=mean)
        torch.manual_seed(7 + dist.get_rank() if dist.is_initialized() else 7)  # ranks' RNGs differ on purpose
        model.resize_token_embeddings(new_size, pad_to_multiple_of=multiple, mean_resizing=mean)
        assert model.config.vocab_size == reference.config.vocab_size
        inputs = _inputs(extra[0] if extra else "", reference.config.vocab_size)
        inputs["input_ids"][0, :3] = torch.tensor([reference.config.vocab_size - 1, 100, 99])  # new tokens
        expected = reference(**inputs).logits
        torch.testing.assert_close(model(**inputs).logits, expected, **ATOL)
        if model.get_output_embeddings() is not None and getattr(model.config, "tie_word_embeddings", False):
            assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        folder = save_root / f"{name}-{new_size}-tp{tp}"
        model.save_pretrained(folder)
        reloaded = hf_class.from_pretrained(folder).eval()
        torch.testing.assert_close(reloaded(**inputs).logits, expected, **ATOL)


def _heads_check(paths: dict, tp: int) -> None:
    for name, (_, kind) in HEADS.items():
        reference = getattr(transformers, name).from_pretrained(paths[name]).eval()
        model = getattr(om, name).from_pretrained(paths[name], parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                  progress=False)
        inputs = _inputs(kind, reference.config.vocab_size)
        assert assert_outputs_match(model(**inputs), reference(**inputs), f"{name} tp{tp}") >= 2


def _generate_check(paths: dict, tp: int) -> None:
    """``generate(return_dict_in_generate=True, output_attentions, output_hidden_states, output_scores)``."""
    for name in ("gpt2", "t5", "llama"):
        hf_class, _, ours, _ = LM_FAMILIES[name]
        reference = hf_class.from_pretrained(paths[name], attn_implementation="eager").eval()
        model = getattr(om, ours).from_pretrained(
            paths[name], parallel=om.ParallelConfig(tensor_parallel_size=tp, sequence_parallel=tp > 1),
            attn_implementation="eager", progress=False)
        ids = _ids((2, 6))
        options = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_attentions=True,
                       output_hidden_states=True, output_scores=True, pad_token_id=0)
        expected, got = reference.generate(ids, **options), model.generate(ids, **options)
        assert torch.equal(got.sequences, expected.sequences), name
        assert assert_outputs_match(got, expected, f"generate {name} tp{tp}") > 10


def _options_check(paths: dict, tp: int) -> None:
    """``from_pretrained`` options on a split model: a mismatched vocab-parallel table is re-initialized and
    reported as ``transformers`` reports it, the rest loads; ``torch_dtype`` keeps T5's ``wo`` in fp32."""
    options = dict(vocab_size=120, ignore_mismatched_sizes=True, output_loading_info=True)
    _, expected = transformers.BertForMaskedLM.from_pretrained(paths["bert"], **options)
    model, info = om.BertForMaskedLM.from_pretrained(paths["bert"], parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                     device_map="auto", progress=False, **options)
    assert {key for key, _, _ in info["mismatched_keys"]} == {key for key, _, _ in expected["mismatched_keys"]}
    assert model.get_input_embeddings().weight.shape[0] == -(-120 // tp)
    reference = transformers.BertForMaskedLM.from_pretrained(paths["bert"])
    name = "bert.encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(dict(model.named_parameters())[name], expected_shard(
        model, name, dict(reference.named_parameters())[name].detach()))
    t5 = om.T5ForConditionalGeneration.from_pretrained(paths["t5"], parallel=om.ParallelConfig(tensor_parallel_size=tp),
                                                       torch_dtype=torch.float16, progress=False)
    assert t5.decoder.block[1].layer[2].DenseReluDense.wo.weight.dtype == torch.float32
    assert t5.decoder.block[1].layer[2].DenseReluDense.wi.weight.dtype == torch.float16


def _worker(paths: dict, tp: int, save_root) -> None:
    _options_check(paths, tp)
    _outputs_check(paths, tp)
    _heads_check(paths, tp)
    _resize_check(paths, tp, save_root)
    _generate_check(paths, tp)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_checkpoints(tmp_path_factory.mktemp("contract"))


def test_contract_tp1_matches_transformers(checkpoints, tmp_path):
    _worker(checkpoints, 1, tmp_path)


def test_contract_tp2_matches_transformers(checkpoints, tmp_path):
    run_distributed(_worker, 2, checkpoints, 2, tmp_path, timeout=900)
