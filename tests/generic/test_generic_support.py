"""The generic path in one process: dispatch, parity with transformers, refusals before any collective,
``om.capabilities``, FSDP2 units and the checkpoint view of packed tensors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

import oslo_models as om
from oslo_models.generic import is_generic
from oslo_models.generic.checkpoint import dcp_value, packed_parameters
from oslo_models.generic.protocol import GenericProtocol
from tests.generic.models import CONFIGS, auto_class, save


def test_auto_classes_dispatch_native_generic_and_unsupported():
    assert om.AutoModelForCausalLM.model_class_for(CONFIGS["granite"]()) is transformers.GraniteForCausalLM
    assert om.AutoModelForMaskedLM.model_class_for(CONFIGS["megatron-bert"]()) is transformers.MegatronBertForMaskedLM
    assert om.AutoModelForCausalLM.model_class_for(transformers.LlamaConfig()) is om.LlamaForCausalLM  # native first
    with pytest.raises(ValueError, match="Unsupported model type 'vit' for AutoModelForCausalLM; supported: .*"
                                         "transformers has no AutoModelForCausalLM class for it either"):
        om.AutoModelForCausalLM.from_config(transformers.ViTConfig())


@pytest.mark.parametrize("name", ["mamba", "megatron-bert", "olmoe"])
def test_from_pretrained_equals_transformers(tmp_path, name):
    path = save(tmp_path, [name])[name]
    model = auto_class(name, om).from_pretrained(path)
    reference = auto_class(name).from_pretrained(path)
    assert type(model) is type(reference) and is_generic(model) and not model.training
    assert model.parallel_context.world_size == 1
    ids = torch.randint(3, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids, labels=ids).logits, reference(ids, labels=ids).logits, rtol=0, atol=0)


def test_from_config_draws_what_transformers_draws():
    torch.manual_seed(5)
    model = om.AutoModelForCausalLM.from_config(CONFIGS["cohere"]())
    torch.manual_seed(5)
    reference = transformers.AutoModelForCausalLM.from_config(CONFIGS["cohere"]())
    assert is_generic(model) and model.lm_head.weight is model.model.embed_tokens.weight  # tied, as transformers
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), key


@pytest.fixture
def launched_world(monkeypatch):
    """The environment of rank 0 of 4 under torchrun, with no rendezvous to reach: any collective would fail."""
    for key, value in dict(WORLD_SIZE="4", RANK="0", LOCAL_RANK="0").items():
        monkeypatch.setenv(key, value)
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    yield
    assert not dist.is_initialized()  # the refusal came before any process group


@pytest.mark.parametrize("name, parallel, message", [
    ("mamba", dict(tensor_parallel_size=2), r"'mamba' runs on the generic path .*MambaForCausalLM.*"
     r"tensor_parallel_size=2: 'mamba' has no native family .* no tensor-parallel plan .*It supports: data "
     r"parallelism"),
    ("megatron-bert", dict(pipeline_parallel_size=2, num_microbatches=2),
     "pipeline_parallel_size=2: the generic path pipelines causal LMs .*MegatronBertForMaskedLM is not one"),
    ("mamba", dict(sequence_parallel=True), "sequence_parallel=True: sequence parallelism splits the sequence between "
     "the tensor-parallel regions"),
    ("mamba", dict(context_parallel_size=2), "context_parallel_size=2: 'mamba' has no attention heads"),
    ("megatron-bert", dict(context_parallel_size=2), "splits the sequence of causal LMs .*MegatronBertForMaskedLM"),
    ("granite", dict(expert_parallel_size=2), "expert_parallel_size=2: transformers gives 'granite' no "
     "expert-parallel plan"),
    ("granite", dict(tensor_parallel_size=4, tensor_parallel_mode="2d"), "2D/2.5D/3D grids need the native"),
    ("xglm", dict(activation_checkpointing="selective"), "activation_checkpointing='selective'"),
    # the other checkpointing modes under pp x cp / pp x ep (issue 50; 'full' trains there:
    # test_generic_pipeline_training_options.py)
    ("granite", dict(pipeline_parallel_size=2, num_microbatches=2, context_parallel_size=2,
                     activation_checkpointing="offload"), "activation_checkpointing='offload'"),
    ("dots1", dict(pipeline_parallel_size=2, num_microbatches=2, data_parallel_size=2, expert_parallel_size=2,
                   activation_checkpointing="partitioned"), "activation_checkpointing='partitioned'"),
    # the native stack's long-sequence tools: ignored silently on the generic path before
    ("granite", dict(tiled_loss=True), "tiled_loss=True: the long-sequence tools"),
    ("granite", dict(tiled_mlp=2, activation_offload=True), "tiled_mlp=2, activation_offload=True: the long-seq"),
])
def test_refusals_come_before_any_collective(tmp_path, launched_world, name, parallel, message):
    path = save(tmp_path, [name])[name]
    with pytest.raises(ValueError, match=message):
        auto_class(name, om).from_pretrained(path, parallel=om.ParallelConfig(**parallel))


def test_heads_that_do_not_split_are_refused(launched_world):
    config = transformers.GraniteConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads=3 is not divisible by tensor_parallel_size=2"):
        om.AutoModelForCausalLM.from_config(config, parallel=om.ParallelConfig(tensor_parallel_size=2))
    olmoe = CONFIGS["olmoe"]()  # its plan gathers q/k/v (colwise_gather_output): whole heads are not cut
    olmoe.num_attention_heads = olmoe.num_key_value_heads = 2
    from oslo_models.generic.support import refusals

    assert refusals(olmoe, om.ParallelConfig(tensor_parallel_size=4), transformers.OlmoeForCausalLM) == []


def test_capabilities_native_and_generic(tmp_path):
    mamba = om.capabilities("mamba")
    assert mamba.path == "generic" and mamba.supports("zero_3") and mamba.supports("activation_checkpointing")
    assert not mamba.supports("tensor_parallel") and "'mamba' has no native family" in mamba["tensor_parallel"].why
    assert not mamba.supports("fused_ops") and mamba.supports("pipeline_parallel")
    granite = om.capabilities("granite", task="causal_lm")
    assert granite.supports("tensor_parallel") and granite.supports("sequence_parallel")
    assert not mamba.supports("sequence_parallel")
    llama = om.capabilities("llama")
    assert llama.path == "native" and llama.supports("sequence_parallel") and llama.supports("pipeline_parallel")
    assert not llama.supports("expert_parallel")  # no experts to split
    mixtral = om.capabilities(transformers.MixtralConfig(num_attention_heads=4, num_key_value_heads=2,
                                                         hidden_size=64))
    assert mixtral.supports("expert_parallel") and mixtral.supports("context_parallel")  # router stats over cp
    model = om.AutoModelForCausalLM.from_pretrained(save(tmp_path, ["olmoe"])["olmoe"])
    assert om.capabilities(model).path == "generic" and om.capabilities(model).supports("tensor_parallel")
    assert "olmoe: generic path" in str(om.capabilities(model))
    with pytest.raises(KeyError, match="unknown feature"):
        mamba["warp_drive"]


def test_fsdp_units():
    torch.manual_seed(0)
    mamba = transformers.MambaForCausalLM(CONFIGS["mamba"]())
    units = GenericProtocol().fsdp_units(mamba)  # MambaBlock holds MambaMixer, both named: only the outer one is a unit
    assert [type(u).__name__ for u in units] == ["MambaBlock", "MambaBlock"]
    bert = transformers.MegatronBertForMaskedLM(CONFIGS["megatron-bert"]())
    assert not bert._no_split_modules  # falls back to the repeated blocks
    assert GenericProtocol().fsdp_units(bert) == list(bert.bert.encoder.layer)


def test_packed_tensors_are_stored_as_blocks():
    model = transformers.OlmoeForCausalLM(CONFIGS["olmoe"]())
    packed = packed_parameters(model)
    assert packed == {f"model.layers.{i}.mlp.experts.gate_up_proj": (1, 2) for i in range(2)}
    weight = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    view = dcp_value(weight, packed["model.layers.0.mlp.experts.gate_up_proj"])
    assert view.shape == (4, 2, 32, 64) and view.data_ptr() == weight.data_ptr()  # gate and up blocks, no copy
    assert torch.equal(view[:, 1], weight[:, 32:])  # the up block
