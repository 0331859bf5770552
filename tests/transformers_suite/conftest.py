"""Markers ``transformers``' ``test_modeling_common.py`` uses (registered so pytest does not warn)."""


def pytest_configure(config):
    for marker in ("flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "torch_compile_test",
                   "torch_export_test", "generate", "is_training_test"):
        config.addinivalue_line("markers", f"{marker}: transformers' own test marker")
