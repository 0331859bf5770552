"""The per-class ``Capabilities`` record (``models/common/rules/capabilities.py``, issue 54): declarations merge along
the MRO (a head's and its family's), a family refines one field, and the validation reads the merged record. No process
group; runtime < 1 s."""
from __future__ import annotations

import pytest

import oslo_models as om
from oslo_models.models.bert.modeling_bert import BertForMaskedLM, BertForSequenceClassification
from oslo_models.models.common.rules.capabilities import Capabilities, capabilities_of
from oslo_models.models.common.stack.context_parallel import check_context_parallel
from oslo_models.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
from oslo_models.models.mixtral.modeling_mixtral import MixtralForCausalLM
from tests.helpers import zoo


def test_records_merge_along_the_mro():
    # context parallelism from ForCausalLM, the MoE fields from MixtralPreTrainedModel
    assert capabilities_of(MixtralForCausalLM) == Capabilities(True, True, True, True)
    # DeepSeek-V3 refines one MoE field and keeps the rest
    assert capabilities_of(DeepseekV3ForCausalLM) == Capabilities(context_parallel=True, moe_context_parallel=True,
                                                                  moe_sequence_parallel=True, moe_grid=False)
    assert capabilities_of(BertForMaskedLM).context_parallel
    assert not capabilities_of(BertForSequenceClassification).context_parallel  # pools one token: no cp
    with pytest.raises(dataclasses_frozen_error()):
        capabilities_of(BertForMaskedLM).context_parallel = False


def test_validation_reads_the_record():
    cp2 = om.ParallelConfig(context_parallel_size=2)
    check_context_parallel(BertForMaskedLM, zoo.tiny_config("bert"), cp2)
    with pytest.raises(NotImplementedError, match="BertForSequenceClassification under context_parallel_size=2"):
        check_context_parallel(BertForSequenceClassification, zoo.tiny_config("bert"), cp2)
    # negative control: a subclass that says it does not run cp is refused, with its parent's record unchanged
    refused = type("NoCP", (BertForMaskedLM,), {"capabilities": Capabilities(context_parallel=False)})
    with pytest.raises(NotImplementedError, match="NoCP under context_parallel_size=2"):
        check_context_parallel(refused, zoo.tiny_config("bert"), cp2)
    assert capabilities_of(BertForMaskedLM).context_parallel


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError
