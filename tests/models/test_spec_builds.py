"""The spec builds the base model (issue 54): every family whose ``StackSpec`` has ``parts``
(``models/common/stack/stack_parts.py``) is built by ``TransformerStack.__init__`` alone, and gives ``transformers``'
module tree: its causal LM has the same state-dict keys as the ``transformers`` twin, its base model
``transformers``' modules in the same order, and, with the twin's weights loaded, the same logits on a right-padded
batch (fp32, 1e-5). The class flags come from the spec.

The encoders (an ``Embeddings`` part; ``common/stack/encoder_stack.py``) likewise: the masked LM's state-dict keys and
logits, the base model's tree with and without ``add_pooling_layer`` and its ``pooler_output``; their
``_no_split_modules`` name the embeddings class and the block.

Negative controls: the same parts in another order register another tree (modules out of ``transformers``' order),
and a spec naming another attention component builds that one (the options read the attention from the spec: it is
named once); an encoder spec with the pooler before the encoder registers it there. One process, no process
group; about 25 s.
"""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from oslo_models.models.common.attention.attention import GroupedQueryAttention
from oslo_models.models.olmo2 import modeling_olmo2 as olmo2
from oslo_models.models.registry import families
from tests.helpers.models import padded_batch
from tests.helpers.zoo import tiny_config


def _built_from_parts(encoders: bool = False) -> list[str]:
    """The model types built from their spec's parts: the decoders, or the encoders (an ``Embeddings`` part)."""
    return [r.model_type for r in families() if r.stack_spec() is not None and r.stack_spec().parts
            and (r.stack_spec().embeddings_module is not None) == encoders]


def _pair(model_type: str, model_class=None):
    record = next(r for r in families() if r.model_type == model_type)
    model_class = model_class or record.model_class("causal_lm")
    torch.manual_seed(0)
    theirs = model_class.hf_twin(tiny_config(model_type)).eval()  # each its own config: transformers writes to it
    return model_class.from_config(tiny_config(model_type)).eval(), theirs


def _children(module) -> list[str]:
    return [name for name, _ in module.named_children()]


def test_every_decoder_and_encoder_is_built_from_its_parts():
    assert len(_built_from_parts()) >= 21  # every decoder family
    assert set(_built_from_parts(encoders=True)) >= {"bert", "roberta", "xlm-roberta", "camembert", "electra",
                                                     "albert", "distilbert", "deberta-v2", "modernbert"}


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


@pytest.mark.parametrize("model_type", _built_from_parts(encoders=True))
def test_encoder_parts_give_transformers_tree_and_outputs(model_type):
    record = next(r for r in families() if r.model_type == model_type)
    ours, theirs = _pair(model_type, record.model_class("masked_lm"))
    base = type(ours).base_model_class
    assert "__init__" not in base.__dict__  # no hand-written __init__ restating the spec
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert _children(ours.base_model) == _children(theirs.base_model)  # no pooler under a masked LM
    ours.load_state_dict(theirs.state_dict())
    ids, mask, _ = padded_batch(theirs.config.vocab_size, batch=2, seq=8)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)
    spec = base.stack_spec
    assert base._no_split_modules == [spec.embeddings_module.__name__, spec.block.__name__]
    assert base._supports_sdpa == ("sdpa" in spec.attention_kernels)
    assert base._can_record_outputs == spec.recorded_outputs
    # the base model as transformers builds it by default (the pooler when the family has one), and without it
    takes_pooling = "add_pooling_layer" in inspect.signature(base.hf_twin.__init__).parameters  # not ELECTRA
    for pooling in ({"add_pooling_layer": True}, {"add_pooling_layer": False}) if takes_pooling else ({},):
        torch.manual_seed(0)
        theirs_base = base.hf_twin(tiny_config(model_type), **pooling).eval()
        ours_base = base(tiny_config(model_type), **pooling).eval()
        assert _children(ours_base) == _children(theirs_base)
        assert set(ours_base.state_dict()) == set(theirs_base.state_dict())
        ours_base.load_state_dict(theirs_base.state_dict())
        with torch.no_grad():
            mine, hf = ours_base(ids, attention_mask=mask), theirs_base(ids, attention_mask=mask)
        for name in ("last_hidden_state", "pooler_output"):
            if getattr(hf, name, None) is not None:
                torch.testing.assert_close(getattr(mine, name), getattr(hf, name), atol=1e-5, rtol=1e-5)


def test_encoder_part_order_is_the_module_tree_order():
    """Negative control: BERT's pooler part moved before the encoder registers ``pooler`` second."""
    from oslo_models.models.bert import modeling_bert as bert

    parts = bert.BERT_SPEC.parts
    moved = dataclasses.replace(bert.BERT_SPEC, parts=(parts[0], parts[-1], *parts[1:-1]))
    pretrained = type("MovedPreTrainedModel", (bert.BertPreTrainedModel,), {"stack_spec": moved})
    model = type("MovedModel", (pretrained, bert.BertModel), {})
    ours, theirs = model.from_config(tiny_config("bert")), bert.BertModel.hf_twin(tiny_config("bert"))
    assert set(ours.state_dict()) == set(theirs.state_dict())
    assert _children(ours) == ["embeddings", "pooler", "encoder"] != _children(theirs)
