"""``transformers``' own common model tests, fetched for the installed ``transformers`` version.

The ``transformers`` wheel ships ``transformers.testing_utils`` but not its test suite. Its source distribution
on PyPI ships the common mixins (``tests/test_modeling_common.py`` with ``ModelTesterMixin``,
``tests/test_configuration_common.py``), but not ``tests/models/`` (the family test files) nor
``tests/generation/`` and ``tests/exporters/`` (which ``test_modeling_common.py`` imports). So this module:

1. downloads the sdist of exactly the installed version with ``pip download --no-binary :all: --no-deps`` (PyPI
   only; no GitHub, no Hub) into a cache, once (a file lock serializes pytest-xdist workers);
2. extracts the top-level ``tests/*.py`` unmodified into a package named ``hf_model_tests`` (our own tests are
   the package ``tests``), and adds empty ``GenerationTesterMixin`` / ``ExportTesterMixin`` placeholders for the
   two modules the sdist lacks (the generation and export mixins' tests are therefore not run);
3. puts the cache on ``sys.path`` and imports ``hf_model_tests.test_modeling_common``.

``OSLO_HF_TESTS_DIR`` may point to a ``transformers`` checkout's ``tests`` folder of the same version instead
(then the real ``generation``/``exporters`` modules are used). When neither works, ``load_common()`` returns the
reason and the suite skips with it.
"""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

PACKAGE = "hf_model_tests"
_PLACEHOLDERS = {  # modules test_modeling_common.py imports that the sdist does not ship
    "generation/test_utils.py": "class GenerationTesterMixin:\n    \"\"\"Placeholder: not in the sdist.\"\"\"\n",
    "exporters/test_export.py": "class ExportTesterMixin:\n    \"\"\"Placeholder: not in the sdist.\"\"\"\n",
}


def cache_root() -> Path:
    base = os.environ.get("OSLO_HF_TESTS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "oslo_models")
    return Path(base) / f"transformers-tests-{transformers.__version__}"


def _download_sdist(target: Path) -> Path:
    version = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", f"transformers=={version}", "--no-binary", ":all:",
                   "--no-deps", "--no-build-isolation", "-q", "-d", tmp]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        archives = list(Path(tmp).glob("transformers-*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download transformers=={version} (sdist) failed: {done.stderr.strip()[-500:]}")
        shutil.copy(archives[0], target)
    return target


def _extract(archive: Path, package_dir: Path) -> None:
    staging = package_dir.with_name(package_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py") and member.isfile():
                (staging / parts[2]).write_bytes(tar.extractfile(member).read())
    if not (staging / "test_modeling_common.py").exists():
        raise RuntimeError(f"{archive.name} has no tests/test_modeling_common.py")
    (staging / "__init__.py").touch()
    for relative, text in _PLACEHOLDERS.items():
        path = staging / relative
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent / "__init__.py").touch()
            path.write_text(text)
    shutil.rmtree(package_dir, ignore_errors=True)
    staging.rename(package_dir)  # atomic: a half-extracted folder is never imported


def _prepare() -> Path:
    """The folder holding the ``hf_model_tests`` package (downloaded and extracted once per version)."""
    checkout = os.environ.get("OSLO_HF_TESTS_DIR")
    root = cache_root()
    package_dir = root / PACKAGE
    if checkout:
        root = Path(tempfile.mkdtemp(prefix="oslo-hf-tests-"))
        (root / PACKAGE).symlink_to(Path(checkout).resolve())
        return root
    if (package_dir / "test_modeling_common.py").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root / ".lock"), timeout=600):
        if not (package_dir / "test_modeling_common.py").exists():
            archive = root / f"transformers-{transformers.__version__}.tar.gz"
            if not archive.exists():
                _download_sdist(archive)
            _extract(archive, package_dir)
    return root


def load_common():
    """``(hf_model_tests.test_modeling_common module, None)`` or ``(None, reason to skip)``."""
    try:
        root = _prepare()
    except Exception as error:  # offline CI, PyPI unreachable, a version without tests in its sdist
        return None, f"transformers' common model tests unavailable for {transformers.__version__}: {error}"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"{PACKAGE}.test_modeling_common"), None
    except Exception as error:  # e.g. a test-only dependency (parameterized) missing
        return None, f"cannot import transformers' test_modeling_common ({transformers.__version__}): {error!r}"
