"""The family records (``oslo_models/models/<family>/__init__.py``, ``FAMILIES``) are the one source of the Auto
classes' tables, ``oslo_models``' family names and the test zoo:

- every record resolves its config class and every class it names, each with the record's ``model_type``;
- every Auto class's table is exactly the records' classes for its task;
- the lazy public names are the records' names plus the non-family names, and each resolves;
- collecting the records imports no model code (no torch);
- a record registered at run time is built by the Auto classes; an unknown model type still raises the
  ``ValueError`` the Auto classes always raised.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import transformers

import oslo_models as om
from oslo_models.models import auto, registry
from oslo_models.models.family import TASKS, FamilyRecord
from tests.helpers import zoo

RECORDS = registry.in_tree_families()
AUTO_CLASSES = [getattr(auto, name) for name in dir(auto)
                if name.startswith("AutoModel") and issubclass(getattr(auto, name), auto._AutoModel)]


def test_every_folder_declares_its_model_types():
    assert {r.model_type for r in RECORDS} == {
        "bert", "gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "roberta", "xlm-roberta",
        "camembert", "switch_transformers", "t5", "mt5", "gemma", "gemma2", "gemma3_text", "olmo2", "gpt_neox",
        "gptj", "phi", "opt", "bloom", "falcon", "phi3", "starcoder2", "qwen3_moe", "deepseek_v3", "gpt_oss",
        "distilbert", "electra", "albert", "deberta-v2", "modernbert", "bart"}
    by_package = {}
    for record in RECORDS:
        by_package.setdefault(record.package.rsplit(".", 1)[-1], []).append(record.model_type)
    assert by_package["roberta"] == ["roberta", "xlm-roberta", "camembert"] and by_package["t5"] == ["t5", "mt5"]
    assert by_package["llama"] == ["llama"]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.model_type)
def test_record_resolves_its_classes(record):
    config_class = record.config_class()
    assert config_class.__name__ == record.config and config_class.model_type == record.model_type
    assert record.classes, record
    for task, name in record.classes.items():
        model_class = record.model_class(task)
        assert model_class.__name__ == name
        assert model_class.config_class.model_type == record.model_type, (task, name)
        assert model_class.config_class is config_class
    assert record.public_names()[0] == record.config
    assert record.spec is None or hasattr(__import__(record.package, fromlist=["_"]), record.spec)


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.model_type)
def test_tiny_config_is_transformers_config(record):
    """The zoo's tiny model is small and splits at tp 2 and 4 (a GQA ratio for the Llama family)."""
    config = zoo.tiny_config(record.model_type)
    assert type(config) is transformers.CONFIG_MAPPING[record.model_type]
    heads = getattr(config, "num_attention_heads", None) or config.num_heads
    hidden = getattr(config, "hidden_size", None) or config.d_model
    assert heads % 4 == 0 and hidden <= 64 and config.vocab_size <= 128
    assert 2 <= config.num_hidden_layers <= 4
    if record.model_type == "llama":
        assert config.num_key_value_heads < config.num_attention_heads
    assert zoo.tiny_kwargs(record.model_type) is not zoo.tiny_kwargs(record.model_type)  # a fresh copy each time


def test_records_are_read_only():
    record = RECORDS[0]
    with pytest.raises(AttributeError):
        record.model_type = "other"  # frozen
    with pytest.raises(TypeError):
        record.classes["base"] = "Other"
    with pytest.raises(TypeError):
        record.tiny_config["vocab_size"] = 7
    with pytest.raises(ValueError, match="unknown task"):
        FamilyRecord(model_type="x", package="x", config="XConfig", classes={"causal": "X"})


@pytest.mark.parametrize("auto_class", AUTO_CLASSES, ids=lambda c: c.__name__)
def test_auto_tables_come_from_records(auto_class):
    assert auto_class.task in TASKS
    expected = {r.model_type: r.model_class(auto_class.task) for r in RECORDS if auto_class.task in r.classes}
    assert expected, auto_class
    assert registry.task_table(auto_class.task) == expected
    for model_type, model_class in expected.items():
        assert auto_class.model_class_for(transformers.AutoConfig.for_model(model_type)) is model_class


def test_every_task_has_an_auto_class():
    assert sorted(c.task for c in AUTO_CLASSES) == sorted(TASKS)


def test_lazy_names_are_records_plus_the_rest():
    family_names = {name for record in RECORDS for name in record.public_names()}
    other = {name for names in om._LAZY.values() for name in names}
    assert not family_names & other
    assert set(om.__all__) == family_names | other
    assert set(dir(om)) >= set(om.__all__)
    for record in RECORDS:
        package = __import__(record.package, fromlist=["_"])
        for name in record.public_names():
            assert getattr(om, name) is getattr(package, name), name
    with pytest.raises(AttributeError):
        getattr(om, "NotAModel")


def test_finding_records_imports_no_model_code():
    code = ("import sys, oslo_models as om; from oslo_models.models import registry; "
            "assert len(registry.families()) > 10; om.__all__; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m == 'transformers' or '.modeling_' in m); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


class OsloTestLlamaConfig(transformers.LlamaConfig):
    model_type = "oslo_test_llama"


class OsloTestLlamaForCausalLM(om.LlamaForCausalLM):
    config_class = OsloTestLlamaConfig


@pytest.fixture
def test_llama_record():
    record = FamilyRecord(model_type="oslo_test_llama", package=__name__, config="OsloTestLlamaConfig",
                          classes={"causal_lm": "OsloTestLlamaForCausalLM"},
                          tiny_config=zoo.tiny_kwargs("llama"))
    om.register_family(record)
    yield record
    registry.unregister_family(record.model_type)


def test_registered_family_is_built_by_auto(test_llama_record):
    config = zoo.tiny_config("oslo_test_llama")
    assert type(config) is OsloTestLlamaConfig and config.num_key_value_heads == 2
    model = om.AutoModelForCausalLM.from_config(config)
    assert type(model) is OsloTestLlamaForCausalLM
    assert registry.family_record("oslo_test_llama") is test_llama_record
    assert "oslo_test_llama" in zoo.model_types()
    with pytest.raises(ValueError, match="Unsupported model type 'oslo_test_llama' for AutoModel;"):
        om.AutoModel.from_config(config)  # no class for that task
    with pytest.raises(ValueError, match="already registered"):
        om.register_family(test_llama_record)
    assert om.register_family(test_llama_record, exist_ok=True) is test_llama_record
    assert "OsloTestLlamaForCausalLM" not in om.__all__  # out-of-tree names stay in their own module


def test_unknown_model_type_raises():
    config = transformers.ViTConfig()  # no native family, and transformers has no causal LM for it (generic path)
    with pytest.raises(ValueError, match="Unsupported model type 'vit' for AutoModelForCausalLM; supported: "):
        om.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="Unsupported model type 'oslo_test_llama'"):
        registry.family_record("oslo_test_llama")  # unregistered by the fixture
    with pytest.raises(ValueError, match="in-tree"):
        registry.unregister_family("llama")
    with pytest.raises(TypeError):
        om.register_family({"model_type": "x"})


def test_readme_support_matrix_is_generated_from_the_records():
    """The README's table is ``oslo_models.models.support``'s output (regenerate with ``python -m
    oslo_models.models.support --write README.md docs/models.md``), and it refuses what the validation code refuses."""
    from pathlib import Path

    from oslo_models.models import support

    table = support.support_matrix_markdown()
    for page in ("README.md", "docs/models.md"):
        text = (Path(__file__).resolve().parents[2] / page).read_text()
        assert f"<!-- support-matrix:start -->\n{table}\n<!-- support-matrix:end -->" in text, (
            f"{page}'s support matrix is stale: run python -m oslo_models.models.support --write README.md "
            "docs/models.md")
    rows = {row["model_type"]: row["axes"] for row in support.support_rows()}
    assert set(rows) == {record.model_type for record in registry.families()}
    assert {column for column, reason in rows["llama"].items() if reason is not None} == {"ep"}
    assert rows["mixtral"]["sp"] is None and rows["mixtral"]["cp"] is None and rows["mixtral"]["ep"] is None
    assert rows["mixtral"]["2d/2.5d/3d"] is None  # experts replicated on the 2D grid (common/feed_forward/moe.py)
    assert "mixture-of-experts" in rows["deepseek_v3"]["2d/2.5d/3d"]
    assert "mixture-of-experts" in rows["switch_transformers"]["sp"]
    # the cp cores soft-cap, add ALiBi and sinks in each block and take MLA's narrower values (issue 52)
    assert all(rows[t]["cp"] is None for t in ("gemma2", "bloom", "gpt_oss", "deepseek_v3"))
