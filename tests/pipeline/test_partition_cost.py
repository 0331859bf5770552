"""The cost-based pipeline partition itself (parity passes for any partition, so it cannot tell a bad one):

- ``partition_by_cost`` on small hand-computed cases with the first and last stage's extra cost, and against a
  brute force over every contiguous split;
- ``pipeline_partition="parameters"``: each family's per-layer and first/last-stage parameter counts equal the
  parameters ``transformers``' module tree really holds there (counted here by module prefix, by hand), and the
  layers each stage gets for a real config equal the hand-computed split.
"""
from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import transformers

import oslo_models as om
from oslo_models.pipeline.partition import partition_by_cost
from oslo_models.pipeline.stage import build_layout
from tests.helpers.encoders import tiny_bert_config, tiny_t5_config
from tests.helpers.models import tiny_gpt2_config


@pytest.mark.parametrize("costs,stages,first,last,expected", [
    # The last stage also pays 3: (2, 2, 1) costs 4, 4, 1+3; every other split has a stage above 4.
    ([2, 2, 2, 2, 1], 3, 0, 3, (2, 2, 1)),
    ([1, 2, 2, 2, 2], 3, 3, 0, (1, 2, 2)),  # mirrored on the first stage
    ([1] * 8, 3, 2, 2, (2, 4, 2)),  # 2+2, 4, 2+2: the only split with no stage above 4
    ([4, 1, 1, 1, 1, 4], 2, 0, 2, (4, 2)),  # 7 | 5+2: (3, 3) gives 6 | 8, (5, 1) 8 | 6
    ([5, 1, 1, 1], 2, 0, 0, (1, 3)),
    ([1, 1, 1, 1], 4, 0, 0, (1, 1, 1, 1)),
])
def test_partition_by_cost_hand_computed(costs, stages, first, last, expected):
    assert partition_by_cost(costs, stages, first_extra=first, last_extra=last) == expected


def _stage_costs(costs, counts, first, last):
    bounds = list(itertools.accumulate(counts, initial=0))
    values = [sum(costs[bounds[s]:bounds[s + 1]]) for s in range(len(counts))]
    values[0] += first
    values[-1] += last
    return values


def test_partition_by_cost_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        num_layers = rng.randint(1, 7)
        stages = rng.randint(1, num_layers)
        costs = [rng.randint(1, 9) for _ in range(num_layers)]
        first, last = rng.choice([0, 0, 3, 11]), rng.choice([0, 0, 4, 13])
        counts = partition_by_cost(costs, stages, first_extra=first, last_extra=last)
        assert len(counts) == stages and min(counts) >= 1 and sum(counts) == num_layers
        best = min(max(_stage_costs(costs, split, first, last))
                   for cut in itertools.combinations(range(1, num_layers), stages - 1)
                   for split in [tuple(b - a for a, b in zip((0,) + cut, cut + (num_layers,)))])
        assert max(_stage_costs(costs, counts, first, last)) == best, (costs, stages, first, last, counts)


def _count(model, prefixes) -> int:
    """Parameters under any of ``prefixes``, each tensor once (tied copies within the group count once)."""
    seen = {id(p): p.numel() for name, p in model.named_parameters(remove_duplicate=False)
            if name.startswith(tuple(prefixes))}
    return sum(seen.values())


# family: (oslo class, transformers model, layer prefixes, first-stage prefixes, last-stage prefixes)
_T5 = tiny_t5_config(num_layers=3, num_decoder_layers=2)
FAMILIES = {
    "gpt2": (om.GPT2LMHeadModel, lambda: transformers.GPT2LMHeadModel(tiny_gpt2_config(n_layer=3)),
             [["transformer.h.0."], ["transformer.h.1."], ["transformer.h.2."]],
             ["transformer.wte.", "transformer.wpe."], ["transformer.ln_f.", "lm_head."]),
    "bert-mlm": (om.BertForMaskedLM, lambda: transformers.BertForMaskedLM(tiny_bert_config()),
                 [["bert.encoder.layer.0."], ["bert.encoder.layer.1."]], ["bert.embeddings."], ["cls."]),
    "bert-cls": (om.BertForSequenceClassification,
                 lambda: transformers.BertForSequenceClassification(tiny_bert_config(num_labels=3)),
                 [["bert.encoder.layer.0."], ["bert.encoder.layer.1."]], ["bert.embeddings."],
                 ["bert.pooler.", "classifier."]),
    "roberta-mlm": (om.RobertaForMaskedLM,
                    lambda: transformers.RobertaForMaskedLM(tiny_bert_config(transformers.RobertaConfig)),
                    [["roberta.encoder.layer.0."], ["roberta.encoder.layer.1."]], ["roberta.embeddings."],
                    ["lm_head."]),
    "t5": (om.T5ForConditionalGeneration, lambda: transformers.T5ForConditionalGeneration(_T5),
           [["encoder.block.0."], ["encoder.block.1."], ["encoder.block.2.", "encoder.final_layer_norm."],
            ["decoder.block.0."], ["decoder.block.1."]],
           ["shared."], ["decoder.final_layer_norm.", "lm_head."]),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_costs_are_the_real_parameter_counts(family):
    oslo_cls, build, layers, first, last = FAMILIES[family]
    reference = build()
    costs, first_extra, last_extra = oslo_cls.pipeline_adapter().layer_parameter_counts(reference)
    assert costs == [_count(reference, prefixes) for prefixes in layers]
    assert (first_extra, last_extra) == (_count(reference, first), _count(reference, last))
    # and the groups cover the whole model, tied head copy counted on both ends
    assert sum(costs) + first_extra + last_extra >= sum(p.numel() for p in reference.parameters())


def test_parameters_partition_of_a_real_model():
    # GPT-2, h=32, 4 layers: a layer is 4h + (3h^2 + 3h) + (h^2 + h) + (4h^2 + 4h) + (4h^2 + h) = 12704 parameters.
    # First stage: wte 101*32 + wpe 512*32 = 19616; last: the tied head 3232 + ln_f 64 = 3296.
    # pp=2: (1, 3) costs 32320 | 41408, (2, 2) 45024 | 28704, (3, 1) 57728 | 16000 -> (1, 3).
    # pp=2 x virtual 2 (4 stages, one layer each, the only split) and pp=4 alike.
    model = om.GPT2LMHeadModel(tiny_gpt2_config(n_layer=4, n_positions=512))
    for pp, virtual, expected in [(2, 1, [range(0, 1), range(1, 4)]), (4, 1, [range(i, i + 1) for i in range(4)])]:
        config = om.ParallelConfig(pipeline_parallel_size=pp, virtual_pipeline_size=virtual,
                                   pipeline_partition="parameters")
        layout = build_layout(model, SimpleNamespace(config=config, pp_size=pp, pp_rank=0))
        assert list(layout.ranges) == expected
    # BERT-MLM with a large vocabulary: the head (transform 1056 + LayerNorm 64 + tied decoder 640000 + its bias
    # 20000 = 661120) outweighs the embeddings ((20000 + 64 + 2) * 32 + LayerNorm 64 = 642176); a layer is
    # 4 * (h^2 + h) + (64h + 64) + (64h + h) + 4h = 8544. (2, 2): 659264 | 678208; (3, 1): 667808 | 669664 -> (3, 1).
    # Without the last stage's extra, or with it on the first stage, the split would be (1, 3).
    heavy = om.BertForMaskedLM(tiny_bert_config(vocab_size=20000, num_hidden_layers=4))
    config = om.ParallelConfig(pipeline_parallel_size=2, pipeline_partition="parameters")
    assert list(build_layout(heavy, SimpleNamespace(config=config, pp_size=2, pp_rank=0)).ranges) == [
        range(0, 3), range(3, 4)]
