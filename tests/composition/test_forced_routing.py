"""The forced-routing comparison of the low-precision MoE layouts (``tests/helpers/forced_routing.py``) does what it
says: a model whose router would choose other experts than the reference's for some tokens routes them where the
reference did once forced (and not without: the negative control), and a token the reference never saw fails."""
from __future__ import annotations

import pytest
import torch

from oslo_models.composition.table import representative
from tests.helpers.forced_routing import ForcedRouting


def _models(tmp_path):
    model_class, config = representative("mixtral")
    torch.manual_seed(0)
    model_class.hf_twin(config).save_pretrained(tmp_path)
    reference = model_class.hf_twin.from_pretrained(tmp_path).eval()
    model = model_class.from_pretrained(tmp_path, progress=False).eval()
    with torch.no_grad():  # a slightly different router: some tokens' top-k changes
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.add_(torch.randn_like(param) * 0.05 * param.abs().mean())
    return model, reference, config


def _indices(module_owner, store):
    """Hooks recording each router's final ``index`` (after any earlier hook replaced it)."""
    return [module.register_forward_hook(lambda m, a, out, n=name: store.__setitem__(n, out[2]))
            for name, module in module_owner.named_modules() if name.endswith("mlp.gate")]


def test_forced_routing_takes_the_references_experts(tmp_path):
    model, reference, config = _models(tmp_path)
    ids = torch.randint(1, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    expected, unforced, forced_got = {}, {}, {}
    hooks = _indices(reference, expected)
    with torch.no_grad():
        reference(input_ids=ids)
        hooks += _indices(model, unforced)
        model(input_ids=ids)
    differs = [name for name in expected if not torch.equal(unforced[name].sort(1).values,
                                                             expected[name].sort(1).values)]
    assert differs, "the perturbed router should choose other experts for some tokens (negative control)"
    forced = ForcedRouting(model, reference)  # registered after: its hooks run before the recording ones below
    for hook in hooks:
        hook.remove()
    hooks = _indices(reference, expected) + _indices(model, forced_got)
    with torch.no_grad():
        forced.begin_step()
        reference(input_ids=ids)
        model(input_ids=ids)
    assert forced.flips > 0 and forced.decisions == ids.numel() * config.num_hidden_layers
    for name in expected:
        torch.testing.assert_close(forced_got[name], expected[name], rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(AssertionError, match="of its norm from every reference token"):
        forced.begin_step()
        reference(input_ids=ids)
        model(input_ids=(ids + 1) % config.vocab_size)  # tokens the reference never saw
    forced.remove()
