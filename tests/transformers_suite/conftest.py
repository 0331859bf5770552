"""Markers ``transformers``' ``test_modeling_common.py`` uses (registered so pytest does not warn), and the default
selection: only the ``CORE`` tests of ``test_transformers_common.py`` unless ``OSLO_HF_TESTS=full``."""
import os


def pytest_configure(config):
    for marker in ("flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test",
                   "torch_export_test", "generate", "is_training_test"):
        config.addinivalue_line("markers", f"{marker}: transformers' own test marker")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("OSLO_HF_TESTS") == "full":
        return
    from .selection import CORE

    kept, dropped = [], []
    for item in items:
        inside = "transformers_suite" in str(item.fspath)
        (dropped if inside and item.name.split("[")[0] not in CORE else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
