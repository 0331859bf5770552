"""The component options the next Hub families compose (issue 25), each against ``transformers``' own module with
the same weights (fp32, atol 1e-5), and every component with a weight split at tp=2 (one spawned gloo group for
all of them) against its single-process output, each with a negative control that a wrong split fails."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.gemma.modeling_gemma import GemmaMLP, GemmaRMSNorm
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding
from transformers.models.gptj.modeling_gptj import GPTJMLP
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention, Olmo2RMSNorm, Olmo2RotaryEmbedding
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.phi.modeling_phi import PhiAttention, PhiRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3MLP

import oslo_models as om
from oslo_models.models.common import (
    DenseMLP,
    FullWidthQKNormAttention,
    FullWidthRMSNorm,
    GatedMLP,
    GroupedQueryAttention,
    LearnedPositionalEmbedding,
    PackedGatedMLP,
    ParameterFreeLayerNorm,
    PartialRotaryEmbedding,
    RMSNorm,
    RotaryEmbedding,
    SinkAttention,
    alibi_slopes,
    build_alibi,
    local_alibi_slopes,
)
from oslo_models.parallel_layers.plan import Colwise, ParallelPlan
from oslo_models.parallel_layers.sharding import HeadSplit
from tests.helpers.dist import run_distributed

ATOL = dict(atol=1e-5, rtol=1e-5)
B, S, H = 2, 5, 32


def _attn_config(cls, **extra):
    config = cls(**{**dict(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           intermediate_size=64, attention_dropout=0.0), **extra})
    config._attn_implementation = "eager"
    return config


def _causal_mask(s: int = S) -> torch.Tensor:
    return torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None].expand(B, 1, s, s)


def _randomize(module: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, std)
    return module


def _positions(rotary, config):
    x = torch.zeros(B, S, H)
    return rotary(config)(x, torch.arange(S)[None].expand(B, S))


def _load(ours: torch.nn.Module, theirs: torch.nn.Module, rename: dict | None = None) -> torch.nn.Module:
    state = {(rename or {}).get(k.split(".")[0], k.split(".")[0]) + k[len(k.split(".")[0]):]: v
             for k, v in theirs.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return ours


def _same(ours, theirs, *args, **kwargs):
    torch.manual_seed(1)
    x = torch.randn(B, S, H)
    expected = theirs(x, *args, **kwargs)
    got = ours(x, *args, **kwargs)
    if isinstance(expected, tuple):
        expected, got = expected[0], got[0]
    torch.testing.assert_close(got, expected, **ATOL)
    return got


# ---------------------------------------------------------------------------------------------- norms
@pytest.mark.parametrize("formula,twin", [("gemma", GemmaRMSNorm), ("olmo2", Olmo2RMSNorm)])
def test_rms_norm_formulas_match_transformers(formula, twin):
    torch.manual_seed(0)
    theirs = _randomize(twin(H, eps=1e-6))
    ours = _load(RMSNorm(H, eps=1e-6, formula=formula), theirs)
    _same(ours, theirs)
    x = torch.randn(B, S, H, dtype=torch.bfloat16)  # the half-precision rounding is the twin's, bit for bit
    assert torch.equal(ours.to(torch.bfloat16)(x), theirs.to(torch.bfloat16)(x))
    if formula == "gemma":  # fresh gemma norms hold zeros (the offset from one), as transformers'
        assert torch.equal(RMSNorm(H, formula="gemma").weight, GemmaRMSNorm(H).weight)


def test_parameter_free_layer_norm_matches_olmo():
    ours, theirs = ParameterFreeLayerNorm(H), OlmoLayerNorm(H)
    assert not list(ours.parameters()) and ParameterFreeLayerNorm.tp_plan[""].hf_style is None
    _same(ours, theirs)


# ---------------------------------------------------------------------------------------------- attention options
def test_softcap_and_scaling_match_gemma2_attention():
    config = _attn_config(transformers.Gemma2Config, query_pre_attn_scalar=16, attn_logit_softcapping=2.0)
    torch.manual_seed(0)
    theirs = _randomize(Gemma2Attention(config, 0), std=0.5)
    ours = _load(GroupedQueryAttention(config, 0, scaling=16 ** -0.5, softcap=2.0), theirs)
    pe = _positions(Gemma2RotaryEmbedding, config)
    out = _same(ours, theirs, position_embeddings=pe, attention_mask=_causal_mask())
    plain = _load(GroupedQueryAttention(config, 0, scaling=16 ** -0.5), theirs)  # control: the cap matters here
    assert not torch.allclose(plain(_x(), pe, _causal_mask())[0], out, atol=1e-3)


def _x() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(B, S, H)


def test_sinks_match_gpt_oss_attention():
    """gpt-oss rotates with half-width ``cos``/``sin`` on the two halves of each head; ``RotaryEmbedding``'s
    duplicated full-width ones with ``rotate_half`` are the same rotation, so the family uses the shared one."""
    config = _attn_config(transformers.GptOssConfig, num_local_experts=2)
    torch.manual_seed(0)
    theirs = _randomize(GptOssAttention(config, 0), std=0.5)
    ours = _load(SinkAttention(config, 0, qkv_bias=True, o_bias=True), theirs)
    pe = _positions(RotaryEmbedding, config)
    expected = theirs(_x(), _positions(GptOssRotaryEmbedding, config), _causal_mask())[0]
    torch.testing.assert_close(ours(_x(), pe, _causal_mask())[0], expected, **ATOL)
    with torch.no_grad():
        ours.sinks.zero_()  # control: the sinks matter
    assert not torch.allclose(ours(_x(), pe, _causal_mask())[0], expected, atol=1e-3)
    config._attn_implementation = "sdpa"  # SDPA would drop the sinks: refused
    with pytest.raises(ValueError, match="sinks"):
        ours(_x(), pe, _causal_mask())


def test_partial_rotary_matches_phi_attention():
    config = _attn_config(transformers.PhiConfig, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    theirs = _randomize(PhiAttention(config, 0))
    ours = _load(GroupedQueryAttention(config, 0, qkv_bias=True, o_bias=True), theirs, rename={"dense": "o_proj"})
    pe = _positions(PartialRotaryEmbedding, config)
    for mine, ref in zip(pe, _positions(PhiRotaryEmbedding, config)):  # the GPT-NeoX frequencies are Phi's too
        assert mine.shape[-1] == 4
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)
    _same(ours, theirs, position_embeddings=pe, attention_mask=_causal_mask())


def test_full_width_qk_norm_matches_olmo2_attention():
    config = _attn_config(transformers.Olmo2Config)
    torch.manual_seed(0)
    theirs = _randomize(Olmo2Attention(config, 0))
    ours = _load(FullWidthQKNormAttention(config, 0), theirs)
    assert ours.q_norm.weight.shape == (32,) and ours.k_norm.weight.shape == (16,)
    _same(ours, theirs, position_embeddings=_positions(Olmo2RotaryEmbedding, config), attention_mask=_causal_mask())


# ---------------------------------------------------------------------------------------------- MLPs
def test_gated_mlp_gelu_tanh_matches_gemma():
    config = transformers.GemmaConfig(hidden_size=H, intermediate_size=64, hidden_act="gelu_pytorch_tanh")
    torch.manual_seed(0)
    theirs = _randomize(GemmaMLP(config))
    _same(_load(GatedMLP(H, 64, act=config.hidden_act), theirs), theirs)


def test_packed_gated_mlp_matches_phi3():
    config = transformers.Phi3Config(hidden_size=H, intermediate_size=64)
    torch.manual_seed(0)
    theirs = _randomize(Phi3MLP(config))
    _same(_load(PackedGatedMLP(H, 64, act=config.hidden_act), theirs), theirs)


class NeoXMLP(DenseMLP):
    names = ("dense_h_to_4h", "dense_4h_to_h")


class GPTJStyleMLP(DenseMLP):
    names = ("fc_in", "fc_out")
    intermediate_attr = "n_inner"


def test_dense_mlp_matches_gpt_neox_and_gptj():
    torch.manual_seed(0)
    neox_config = transformers.GPTNeoXConfig(hidden_size=H, num_attention_heads=4, intermediate_size=64)
    neox = _randomize(GPTNeoXMLP(neox_config))
    _same(_load(NeoXMLP(H, 64, act="gelu"), neox), neox)
    gptj = _randomize(GPTJMLP(64, transformers.GPTJConfig(n_embd=H, n_head=4, resid_pdrop=0.0))).eval()
    _same(_load(GPTJStyleMLP(H, 64, act="gelu_new"), gptj), gptj)
    assert set(NeoXMLP.tp_plan) == {"dense_h_to_4h", "dense_4h_to_h", "dropout"}
    assert [r.value for r in GPTJStyleMLP.parallel_rules(transformers.GPTJConfig(n_embd=H, n_head=4))] == [4 * H]


# ---------------------------------------------------------------------------------------------- positions
def test_learned_positions_match_opt():
    torch.manual_seed(0)
    theirs = _randomize(OPTLearnedPositionalEmbedding(16, H))
    ours = _load(LearnedPositionalEmbedding(16, H, offset=2), theirs)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # left padding
    for past in (0, 4):
        torch.testing.assert_close(ours(mask, past), theirs(mask, past), atol=0, rtol=0)


@pytest.mark.parametrize("heads", [8, 6])
def test_alibi_matches_bloom(heads):
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = build_alibi_tensor(mask, heads, torch.float32).view(B, heads, 1, 5)
    torch.testing.assert_close(build_alibi(mask, alibi_slopes(heads), torch.float32), expected, atol=0, rtol=0)
    local = [build_alibi(mask, local_alibi_slopes(heads, r, 2), torch.float32) for r in range(2)]
    torch.testing.assert_close(torch.cat(local, dim=1), expected, atol=0, rtol=0)  # rank r: heads of its q slice
    assert not torch.equal(local[0], expected[:, 3:6])


# ---------------------------------------------------------------------------------------------- tp=2
def _parallel_copy(plain: torch.nn.Module, ctx, plan: dict) -> tuple[torch.nn.Module, ParallelPlan]:
    """The module under ``plan`` with this rank's slices of ``plain``'s weights."""
    plan = ParallelPlan(plan)
    module = copy.deepcopy(plain)
    plan.apply(module, ctx)
    full = dict(plain.named_parameters())
    with torch.no_grad():
        for name, param in module.named_parameters():
            spec = plan.shard_spec(module, name)
            param.copy_(spec.read_shard(tuple(full[name].shape), full[name].__getitem__, ctx.tp_rank, ctx.tp_size))
    return module, plan


def _check_split(plain, ctx, call, *, plan=None):
    """Output, input gradient and every local parameter gradient of the split module equal the single-process
    ones (the parameter gradients as this rank's slice of the full ones). Returns the split module's output."""
    x = _x().requires_grad_(True)
    expected = call(plain, x)
    probe = torch.randn(expected.shape, generator=torch.Generator().manual_seed(2))
    (expected * probe).sum().backward()
    module, parallel_plan = _parallel_copy(plain, ctx, plan or type(plain).tp_plan)
    x_local = x.detach().clone().requires_grad_(True)
    out = call(module, x_local)
    torch.testing.assert_close(out, expected, **ATOL)
    (out * probe).sum().backward()
    torch.testing.assert_close(x_local.grad, x.grad, **ATOL)
    full = dict(plain.named_parameters())
    for name, param in module.named_parameters():
        spec = parallel_plan.shard_spec(module, name)
        grad = spec.read_shard(tuple(full[name].shape), full[name].grad.__getitem__, ctx.tp_rank, ctx.tp_size)
        torch.testing.assert_close(param.grad, grad, **ATOL, msg=f"gradient of {name}")
    return module, out.detach()


def _attention_call(config):
    pe = _positions(Olmo2RotaryEmbedding, config)
    return lambda module, x: module(x, pe, _causal_mask())[0]


def _tp2_worker() -> None:
    ctx = om.ParallelContext.from_config(om.ParallelConfig(tensor_parallel_size=2))
    other = 1 - ctx.tp_rank

    # gpt-oss sinks: split by query heads like q_proj; the other rank's sinks (a wrong split) must fail
    config = _attn_config(transformers.GptOssConfig, num_local_experts=2)
    torch.manual_seed(0)
    plain = _randomize(SinkAttention(config, 0, qkv_bias=True))
    with torch.no_grad():
        plain.sinks.normal_(0.0, 1.0)
    call = _attention_call(config)
    module, out = _check_split(plain, ctx, call)
    assert module.sinks.shape == (2,)
    with torch.no_grad():
        module.sinks.copy_(plain.sinks[other * 2:(other + 1) * 2])
    assert not torch.allclose(call(module, _x()), out, atol=1e-3)

    # OLMo 2 full-width q/k norms: kv heads split (n_kv=2) and replicated (n_kv=1, tp > n_kv); the statistic is
    # all-reduced; a norm over the local heads only (no all-reduce) must fail
    for kv_heads in (2, 1):
        config = _attn_config(transformers.Olmo2Config, num_key_value_heads=kv_heads)
        torch.manual_seed(0)
        plain = _randomize(FullWidthQKNormAttention(config, 0))
        with torch.no_grad():
            plain.q_norm.weight.add_(1.0), plain.k_norm.weight.add_(1.0)
        call = _attention_call(config)
        module, out = _check_split(plain, ctx, call)
        local_only = FullWidthRMSNorm(module.q_norm.weight.shape[0], config.rms_norm_eps, num_heads=2)
        with torch.no_grad():
            local_only.weight.copy_(module.q_norm.weight)
        module.q_norm = local_only
        assert not torch.allclose(call(module, _x()), out, atol=1e-3)

    # Phi-3's packed gate|up: gate and up each split; splitting the packed rows as one block must fail
    torch.manual_seed(0)
    plain = _randomize(PackedGatedMLP(H, 64))
    _, out = _check_split(plain, ctx, lambda m, x: m(x))
    wrong, _ = _parallel_copy(plain, ctx, {**PackedGatedMLP.tp_plan, "gate_up_proj": Colwise()})
    assert not torch.allclose(wrong(_x()), out, atol=1e-3)

    # a named DenseMLP (GPT-NeoX's names): its plan follows the names
    torch.manual_seed(0)
    plain = _randomize(NeoXMLP(H, 64, act="gelu"))
    module, _ = _check_split(plain, ctx, lambda m, x: m(x))
    assert module.dense_h_to_4h.weight.shape == (32, H) and module.dense_4h_to_h.weight.shape == (H, 32)

    # softcap with split heads: the cap acts per head, nothing else changes
    config = _attn_config(transformers.Gemma2Config, query_pre_attn_scalar=16, attn_logit_softcapping=2.0)
    torch.manual_seed(0)
    plain = _randomize(GroupedQueryAttention(config, 0, scaling=16 ** -0.5, softcap=2.0))
    _check_split(plain, ctx, _attention_call(config))


def test_components_tp2():
    run_distributed(_tp2_worker, 2)


def test_grid_modes_refuse_new_norms():
    """The parameter-free norm and sink attention are 1D only; the full-width (OLMo 2) q/k norm is refused under 3D
    (the gemma formula and the full-width norm under 2D / 2.5D are checked against transformers in
    tests/parallel_layers/test_tp_modes_models.py)."""

    class Grid:
        tensor_parallel_mode, is_grid = "2d", True

    class Cube:
        tensor_parallel_mode, is_grid = "3d", True

    cases = ((ParameterFreeLayerNorm.tp_plan[""], ParameterFreeLayerNorm(H), Grid()),
             (FullWidthQKNormAttention.tp_plan["q_norm"], FullWidthRMSNorm(H, num_heads=4), Cube()),
             (SinkAttention.tp_plan[""], SinkAttention(_attn_config(transformers.GptOssConfig), 0), Grid()))
    for style, module, context in cases:
        with pytest.raises(NotImplementedError):
            style.build(module, context)
    assert HeadSplit(0, 1).replicas(2) == 2
