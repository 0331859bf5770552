"""DeepSeek-V3 and gpt-oss against plain ``transformers``: what the zoo (``test_zoo.py``) does not cover; and the
dropless grouped experts against the padded ones and ``transformers`` for every causal MoE family (Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, gpt-oss) at ep 1 (in process), ep 2 (x edp 2) and ep 2 x tp 2 (in the world).

In process (ep 1): logits, router logits, the loss (gpt-oss: with the load-balancing loss; DeepSeek-V3: none, as
``transformers``), every gradient and the parameters after 3 AdamW steps (fp32, atol 1e-5), for DeepSeek-V3 with a
non-zero ``e_score_correction_bias`` (frozen: equal to the checkpoint's after training), MLA with ``q_lora_rank``
set (the record's tiny model) and unset (a plain ``q_proj``, half-split rotary), and gpt-oss. Negative controls,
one per new component: each particular switched off on our side no longer matches (group limit, correction bias,
yarn ``mscale`` on the score scale, sinks, SwiGLU clamp). gpt-oss checkpoints with MXFP4 experts load dequantized.

One spawned group of 4 ranks: 3 AdamW steps at ep 2 x tp 2 with sequence parallelism (all three), the same with
each expert split over the tp group (``expert_tensor_parallel_size=2``; gpt-oss: its output bias added once), ep 4 and ep 2 on dp 4 with ZeRO-1
(DeepSeek-V3), ep 2 on dp 4 with ZeRO-3 (gpt-oss) through ``om.training.prepare``
(``test_moe_parity._train_matches``); the trained ep 2 x tp 2
models save plain ``transformers`` folders (same keys and shapes, same logits); greedy ``generate`` at ep 2 x tp 2
with a different prompt and length per data-parallel rank equals ``transformers`` (the rank that finishes first
keeps stepping: ``synced_gpus``, or the other would hang in the experts' all-to-all).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import oslo_models as om
from accelerate import Accelerator
from oslo_models.models.gpt_oss.modeling_gpt_oss import check_not_quantized
from oslo_models.models.registry import family_record
from oslo_models.parallel_layers.moe import set_expert_implementation
from tests.helpers.dist import breadcrumb, run_distributed
from tests.helpers.models import padded_batch
from tests.helpers.zoo import tiny_config
from tests.models.test_moe_parity import _train_matches

VARIANTS = {"deepseek_v3": dict(), "deepseek_v3_q": dict(q_lora_rank=None, rope_interleave=False),
            "gpt_oss": dict(), "mixtral": dict(), "qwen2_moe": dict(), "qwen3_moe": dict()}
# every causal MoE family once (Switch Transformers: tests/models/test_switch_parity.py)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
IMPLEMENTATIONS = ("grouped", "padded")


def _model_type(name: str) -> str:
    return name.removesuffix("_q")


def _hf_class(name: str) -> type:
    return family_record(_model_type(name)).model_class("causal_lm").hf_twin


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, paths = tmp_path_factory.mktemp("moe_families"), {}
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        _hf_class(name)(tiny_config(_model_type(name), **overrides)).save_pretrained(root / name)
        if _model_type(name) == "deepseek_v3":  # a correction bias that steers the choice (transformers inits 0)
            file = root / name / "model.safetensors"
            state = load_file(file)
            for key in state:
                if key.endswith("e_score_correction_bias"):
                    state[key] = torch.randn(state[key].shape, generator=torch.Generator().manual_seed(7)) * 0.05
            save_file(state, file, metadata={"format": "pt"})
        paths[name] = str(root / name)
    return paths


def _load(path: str, **parallel):
    return om.AutoModelForCausalLM.from_pretrained(path, parallel=om.ParallelConfig(**parallel), progress=False)


def _buffers_frozen(model, reference) -> None:
    """DeepSeek's correction bias: a buffer, untouched by training, equal to the reference's."""
    expected = {name: buffer for name, buffer in reference.named_buffers() if "e_score" in name}
    for name, buffer in model.named_buffers():
        if "e_score" in name:
            assert torch.equal(buffer, expected[name]) and buffer.abs().sum() > 0, name


def _load_as(path: str, implementation: str, **parallel):
    """The model with its experts run dropless-grouped (the default) or padded to the largest count."""
    model = _load(path, **parallel).train()
    assert set_expert_implementation(model, implementation) > 0
    assert all(layer.mlp.experts.expert_implementation == implementation
               for layer in model.model.layers if layer.is_sparse)
    return model


def test_ep1_matches_transformers(checkpoints):
    """Grouped and padded experts each equal transformers (so each other) for every causal MoE family at ep 1."""
    for name, path in checkpoints.items():
        for implementation in IMPLEMENTATIONS:
            model = _load_as(path, implementation)
            reference = _hf_class(name).from_pretrained(path).train()
            assert type(model).__name__ == type(reference).__name__
            _train_matches(model, reference, dp_rank=0, dp_size=1)
            _buffers_frozen(model, reference)


def _differs(model, reference, ids, mask) -> bool:
    with torch.no_grad():
        return not torch.allclose(model(ids, attention_mask=mask).logits,
                                  reference(ids, attention_mask=mask).logits, atol=1e-4)


def test_each_particular_matters(checkpoints):
    """Negative controls: switching one particular off on our side breaks the match with transformers."""
    ids, mask, _ = padded_batch(61, batch=2, seq=8)
    path = checkpoints["deepseek_v3"]
    reference = _hf_class("deepseek_v3").from_pretrained(path).eval()
    model = _load(path).eval()
    assert not _differs(model, reference, ids, mask)
    gates = [layer.mlp.gate for layer in model.model.layers if layer.is_sparse]
    for gate in gates:  # no group limit: top-k over all experts
        gate.topk_group = gate.n_group
    assert _differs(model, reference, ids, mask)
    for gate in gates:
        gate.topk_group = 2
        gate.e_score_correction_bias.zero_()  # no correction bias in the choice
    assert _differs(model, reference, ids, mask)
    model = _load(path).eval()
    for layer in model.model.layers:  # no yarn mscale on the score scale
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5
    assert _differs(model, reference, ids, mask)

    path = checkpoints["gpt_oss"]
    reference = _hf_class("gpt_oss").from_pretrained(path).eval()
    model = _load(path).eval()
    assert not _differs(model, reference, ids, mask)
    with torch.no_grad():
        for layer in model.model.layers:  # sinks at -inf: a plain softmax
            layer.self_attn.sinks.fill_(-1e4)
    assert _differs(model, reference, ids, mask)
    model = _load(path).eval()
    for layer in model.model.layers:  # no clamp
        layer.mlp.experts.limit = 1e9
    assert _differs(model, reference, ids, mask)


def test_mxfp4_experts_are_dequantized(tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts (``*_blocks``/``*_scales`` and ``quantization_config``, as the Hub's)
    loads dequantized: the same logits as transformers on the dense weights of transformers' own dequantizer; the
    model saves dense weights without the quantization config. Other methods are refused."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    config = tiny_config("gpt_oss", intermediate_size=32)  # MXFP4 packs 32 values per block along each row
    torch.manual_seed(0)
    _hf_class("gpt_oss")(config).save_pretrained(tmp_path / "dense")
    state, packed, generator = load_file(tmp_path / "dense" / "model.safetensors"), {}, torch.Generator()
    generator.manual_seed(3)
    for key, tensor in list(state.items()):
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, width, rows = tensor.shape  # dense [E, G*32, rows]
            blocks = torch.randint(0, 256, (experts, rows, width // 32, 16), dtype=torch.uint8, generator=generator)
            scales = torch.randint(118, 124, (experts, rows, width // 32), dtype=torch.uint8, generator=generator)
            packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
            state[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            packed[key] = tensor
    save_file(state, tmp_path / "dense" / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = {"quant_method": "mxfp4"}
    config.save_pretrained(tmp_path / "mxfp4")
    save_file(packed, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    model = _load(str(tmp_path / "mxfp4")).eval()
    reference = _hf_class("gpt_oss").from_pretrained(tmp_path / "dense").eval()
    assert not hasattr(model.config, "quantization_config")
    ids, mask, _ = padded_batch(61, batch=2, seq=8)
    assert not _differs(model, reference, ids, mask)
    for key in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(model.state_dict()[key], state[key])
    with pytest.raises(ValueError, match="bitsandbytes-quantized weights"):
        check_not_quantized(tiny_config("gpt_oss", quantization_config={"quant_method": "bitsandbytes"}))


def _own_experts(model) -> None:
    ctx = model.parallel_context
    for layer in model.model.layers:
        if layer.is_sparse:
            experts = layer.mlp.experts
            local = experts.num_experts // ctx.ep_size
            assert all(getattr(experts, n).shape[0] == local for n in experts.weight_names)
            assert experts.first_expert == ctx.ep_rank * local


def _generate_per_rank(model, reference, ctx) -> None:
    """Greedy generate, each data-parallel rank its own prompt and length: dp rank 1 stops 3 tokens earlier."""
    prompt = torch.randint(3, 61, (1, 4 + 2 * ctx.dp_rank), generator=torch.Generator().manual_seed(ctx.dp_rank))
    options = dict(max_new_tokens=6 - 3 * ctx.dp_rank, do_sample=False, pad_token_id=0, eos_token_id=None,
                   output_router_logits=False)
    model.eval(), reference.eval()
    assert torch.equal(model.generate(prompt, **options), reference.generate(prompt, **options))


def _layouts_worker(checkpoints: dict, out_root: str) -> None:
    sp = dict(expert_parallel_size=2, tensor_parallel_size=2, sequence_parallel=True)
    runs = [("ep2 x tp2+sp", sp, 0, tuple(checkpoints)),
            # experts split over the whole tp group: partial sums combined, then reduce-scattered
            ("ep2 x tp2+sp etp2", dict(sp, expert_tensor_parallel_size=2), 0, ("deepseek_v3", "gpt_oss")),
            ("ep4", dict(expert_parallel_size=4), 0, ("deepseek_v3",)),  # one expert group per rank
            ("ep2 zero1", dict(expert_parallel_size=2), 1, ("deepseek_v3",)),
            ("ep2 zero3", dict(expert_parallel_size=2), 3, ("gpt_oss",))]
    # grouped (dropless, exact per-expert all-to-all counts) and padded experts at ep 2 (x edp 2) and ep 2 x tp 2,
    # every causal family: each equals transformers
    runs = [(label, layout, zero_stage, names, "grouped") for label, layout, zero_stage, names in runs] + [
        ("ep2", dict(expert_parallel_size=2), 0, FAMILIES, implementation) for implementation in IMPLEMENTATIONS] + [
        ("ep2 x tp2", dict(expert_parallel_size=2, tensor_parallel_size=2), 0, FAMILIES, "padded")]
    for label, layout, zero_stage, names, implementation in runs:
        for name in names:
            path = checkpoints[name]
            breadcrumb(f"{label} {name} {implementation}")
            model = _load_as(path, implementation, **layout)
            ctx = model.parallel_context
            _own_experts(model)
            reference = _hf_class(name).from_pretrained(path).train()
            accelerator = Accelerator(cpu=True) if zero_stage else None
            _train_matches(model, reference, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, zero_stage=zero_stage,
                           accelerator=accelerator)
            if zero_stage or label != "ep2 x tp2+sp":
                continue
            _buffers_frozen(model, reference)
            _generate_per_rank(model, reference, ctx)
            out = os.path.join(out_root, name)
            ids, mask, _ = padded_batch(61)
            logits = model(ids, attention_mask=mask).logits
            model.save_pretrained(out)
            if dist.get_rank() == 0:
                plain = _hf_class(name).from_pretrained(out).eval()
                saved, original = (load_file(os.path.join(folder, "model.safetensors")) for folder in (out, path))
                assert {k: v.shape for k, v in saved.items()} == {k: v.shape for k, v in original.items()}
                torch.testing.assert_close(plain(ids, attention_mask=mask).logits, logits, atol=1e-5, rtol=1e-5)


def test_expert_parallel_layouts_match_transformers(checkpoints, tmp_path):
    run_distributed(_layouts_worker, 4, checkpoints, str(tmp_path), timeout=900)


def test_gpt_oss_swiglu_constants_follow_the_installed_transformers(monkeypatch):
    # transformers 5.17 hard-coded the experts' SwiGLU (1.702, 7.0) and ignored the config's values; later versions
    # read them. The GPU smoke test (transformers 5.17) caught the difference on the tiny config's limit of 0.02.
    import transformers

    from oslo_models.models.gpt_oss.modeling_gpt_oss import swiglu_constants

    config = tiny_config("gpt_oss")
    assert config.swiglu_limit == 0.02
    assert swiglu_constants(config) == (config.swiglu_alpha, 0.02)
    monkeypatch.delattr(transformers.GptOssConfig, "swiglu_limit")
    assert swiglu_constants(config) == (1.702, 7.0)
