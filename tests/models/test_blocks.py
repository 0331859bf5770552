"""The block templates (``oslo_models/models/common/stack/blocks.py``): each computes its residual/norm formula with the
family's attribute names, registers the components under those names (so the state-dict keys are the family's),
and composes the components' plan fragments under those names. Families using them are checked against
``transformers`` end to end (``test_zoo.py``, the family parity tests); this pins the templates themselves, including
the ones no in-tree family uses yet."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from oslo_models.models.common.stack.blocks import (
    ParallelResidualBlock,
    PostNormBlock,
    PreNormBlock,
    ResidualDropout,
    SandwichNormBlock,
)
from oslo_models.parallel_layers.plan import Colwise, Rowwise


class Attention(nn.Module):
    tp_plan = {"q": Colwise(), "o": Rowwise()}

    def __init__(self, width: int):
        super().__init__()
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, attention_mask=None, position_embeddings=None, past_key_values=None, **kwargs):
        assert not kwargs.get("router"), "feed-forward keywords must not reach the attention"
        return self.o(torch.tanh(self.q(x))), None


class MLP(nn.Module):
    tp_plan = {"up": Colwise(), "down": Rowwise()}

    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, router=None):
        if router is not None:
            router.append(x.shape)
        return self.down(torch.relu(self.up(x)))


def _norm(width: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(width)
    nn.init.normal_(norm.weight), nn.init.normal_(norm.bias)
    return norm


NAMES = dict(attn_norm="ln_a", attn="mixer", mlp_norm="ln_m", mlp="ffn", post_attn_norm="ln_pa",
             post_mlp_norm="ln_pm", attn_dropout="drop_a", mlp_dropout="drop_m")


def _part(role: str, width: int) -> nn.Module:
    if role.endswith("_dropout"):
        return ResidualDropout(0.5)
    return Attention(width) if role == "attn" else MLP(width) if role == "mlp" else _norm(width)


def _block(template, roles):
    cls = type(f"Toy{template.__name__}", (template,), {"names": {r: NAMES[r] for r in template.roles},
                                                         "mlp_kwargs": ("router",)})
    parts = {role: _part(role, 8) for role in roles}
    return cls(**parts), parts


def _formulas():
    a = lambda p, x: p["attn"](x)[0]  # noqa: E731
    return {
        PreNormBlock: (("attn_norm", "attn", "mlp_norm", "mlp"),
                       lambda p, x: (lambda h: h + p["mlp"](p["mlp_norm"](h)))(x + a(p, p["attn_norm"](x)))),
        ParallelResidualBlock: (ParallelResidualBlock.roles, lambda p, x: a(p, p["attn_norm"](x))
                                + p["mlp"](p["mlp_norm"](x)) + x),
        PostNormBlock: (PostNormBlock.roles, lambda p, x: (lambda h: p["mlp_norm"](h + p["mlp"](h)))(
            p["attn_norm"](x + a(p, x)))),
        SandwichNormBlock: (SandwichNormBlock.roles, lambda p, x: (lambda h: h + p["post_mlp_norm"](
            p["mlp"](p["mlp_norm"](h))))(x + p["post_attn_norm"](a(p, p["attn_norm"](x))))),
    }


@pytest.mark.parametrize("template", [PreNormBlock, ParallelResidualBlock, PostNormBlock, SandwichNormBlock])
def test_template_formula_names_and_plan(template):
    torch.manual_seed(0)
    roles, formula = _formulas()[template]
    block, parts = _block(template, roles)
    x = torch.randn(2, 5, 8)
    router = []
    torch.testing.assert_close(block(x, None, None, None, router=router), formula(parts, x), atol=0, rtol=0)
    assert router == [torch.Size([2, 5, 8])]  # the feed-forward keyword went to the feed-forward only
    assert {key.split(".")[0] for key in block.state_dict()} == {NAMES[r] for r in roles}
    plan = type(block).tp_plan({"attn": Attention, "mlp": MLP})
    assert plan.keys() == {f"{NAMES['attn']}.q", f"{NAMES['attn']}.o", f"{NAMES['mlp']}.up", f"{NAMES['mlp']}.down"}


def test_optional_roles():
    """One shared norm for attention and MLP (GPT-J, Falcon-7B); post norms only (OLMo 2)."""
    torch.manual_seed(0)
    roles = ("attn_norm", "attn", "mlp")
    block, parts = _block(ParallelResidualBlock, roles)
    x = torch.randn(2, 3, 8)
    shared = parts["attn_norm"](x)
    torch.testing.assert_close(block(x), x + parts["attn"](shared)[0] + parts["mlp"](shared))
    block, parts = _block(SandwichNormBlock, ("attn", "post_attn_norm", "mlp", "post_mlp_norm"))
    h = x + parts["post_attn_norm"](parts["attn"](x)[0])
    torch.testing.assert_close(block(x), h + parts["post_mlp_norm"](parts["mlp"](h)))
    with pytest.raises(TypeError, match="missing roles"):
        _block(PreNormBlock, ("attn", "mlp"))


def test_pre_norm_residual_dropouts():
    """Phi-3 / StarCoder2: each branch's output is dropped before the add (attention's first, as they draw); the
    plan fragment gives each dropout the residual-stream style. Without them (the control) the output differs."""
    torch.manual_seed(0)
    roles = ("attn_norm", "attn", "mlp_norm", "mlp", "attn_dropout", "mlp_dropout")
    block, parts = _block(PreNormBlock, roles)
    x = torch.randn(2, 5, 8)
    torch.manual_seed(1)
    got = block(x)
    torch.manual_seed(1)
    h = x + torch.nn.functional.dropout(parts["attn"](parts["attn_norm"](x))[0], 0.5)
    expected = h + torch.nn.functional.dropout(parts["mlp"](parts["mlp_norm"](h)), 0.5)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    plain, _ = _block(PreNormBlock, roles[:4])
    plain.load_state_dict(block.state_dict())
    torch.manual_seed(1)
    assert not torch.allclose(plain(x), got, atol=1e-3)
    plan = type(block).tp_plan({"attn_dropout": ResidualDropout, "mlp_dropout": ResidualDropout})
    assert set(plan) == {"drop_a", "drop_m"} and type(plan["drop_a"]).__name__ == "TPDropout"
