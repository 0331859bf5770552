"""The spec builds the base model (issue 54): every family whose ``StackSpec`` has ``parts``
(``models/common/stack_parts.py``) is built by ``TransformerStack.__init__`` alone, and gives ``transformers``'
module tree: its causal LM has the same state-dict keys as the ``transformers`` twin, its base model
``transformers``' modules in the same order, and, with the twin's weights loaded, the same logits on a right-padded
batch (fp32, 1e-5). The class flags come from the spec.

Negative controls: the same parts in another order register another tree (modules out of ``transformers``' order),
and a spec naming another attention component builds that one (the options read the attention from the spec: it is
named once). One process, no process group; about 25 s.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from oslo_models.models.common.attention import GroupedQueryAttention
from oslo_models.models.olmo2 import modeling_olmo2 as olmo2
from oslo_models.models.registry import families
from tests.helpers.models import padded_batch
from tests.helpers.zoo import tiny_config


def _built_from_parts() -> list[str]:
    return [r.model_type for r in families() if r.stack_spec() is not None and r.stack_spec().parts]


def _pair(model_type: str, model_class=None):
    record = next(r for r in families() if r.model_type == model_type)
    model_class = model_class or record.model_class("causal_lm")
    torch.manual_seed(0)
    theirs = model_class.hf_twin(tiny_config(model_type)).eval()  # each its own config: transformers writes to it
    return model_class.from_config(tiny_config(model_type)).eval(), theirs


def _children(module) -> list[str]:
    return [name for name, _ in module.named_children()]


def test_every_decoder_is_built_from_its_parts():
    assert len(_built_from_parts()) >= 21  # every decoder family; the encoders still build in their __init__


@pytest.mark.parametrize("model_type", _built_from_parts())
def test_parts_give_transformers_tree_and_outputs(model_type):
    ours, theirs = _pair(model_type)
    base = type(ours).base_model_class
    assert "__init__" not in base.__dict__  # no hand-written __init__ restating the spec
    assert set(ours.state_dict()) == set(theirs.state_dict())
    # transformers' modules in transformers' order (a dropout transformers applies functionally is a module here)
    expected = _children(theirs.base_model)
    assert [name for name in _children(ours.base_model) if name in expected] == expected
    ours.load_state_dict(theirs.state_dict())
    ids, mask, _ = padded_batch(theirs.config.vocab_size, batch=2, seq=8)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)
    spec = base.stack_spec
    assert base._no_split_modules == [spec.block.__name__]
    assert base._supports_sdpa == ("sdpa" in spec.attention_kernels)


def test_part_order_is_the_module_tree_order():
    """Negative control: reversing the parts registers the rotary module before the embeddings."""
    spec = olmo2.OLMO2_SPEC
    shuffled = dataclasses.replace(spec, parts=tuple(reversed(spec.parts)))
    pretrained = type("ShuffledPreTrainedModel", (olmo2.Olmo2PreTrainedModel,), {"stack_spec": shuffled})
    model = type("ShuffledModel", (pretrained, olmo2.Olmo2Model), {})
    ours, theirs = model.from_config(tiny_config("olmo2")), olmo2.Olmo2Model.hf_twin(tiny_config("olmo2"))
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert _children(ours) == ["rotary_emb", "norm", "layers", "embed_tokens"] != _children(theirs)


def test_attention_is_named_once_in_the_spec():
    """OLMo 2's full-width q/k norm attention comes from its spec's components; a spec naming the plain grouped-query
    attention builds that one, and the options follow (no second place to change)."""
    plain = dataclasses.replace(olmo2.OLMO2_SPEC, components={**olmo2.OLMO2_SPEC.components,
                                                              "attn": GroupedQueryAttention})
    pretrained = type("PlainPreTrainedModel", (olmo2.Olmo2PreTrainedModel,), {"stack_spec": plain})
    model = type("PlainModel", (pretrained, olmo2.Olmo2Model), {})
    config = tiny_config("olmo2")
    assert type(olmo2.Olmo2Model.from_config(config).layers[0].self_attn) is olmo2.FullWidthQKNormAttention
    built = model.from_config(config)
    assert type(built.layers[0].self_attn) is GroupedQueryAttention
    assert model.decoder_options(config).attention is GroupedQueryAttention
    assert model._can_record_outputs["attentions"] is GroupedQueryAttention
