"""A tokenizer and a token corpus built once per test process for the fault tests' example runs (each run then
skips training a tokenizer and tokenizing: ``--data PREFIX --tokenizer DIR``), and the fork server their workers
start from (``forkserver.py``: torch imported once per test process, not once per worker)."""
from __future__ import annotations

import os
import sys

import pytest

from tests.faults import forkserver as forkserver_module
from tests.faults import launch
from tests.helpers import examples


@pytest.fixture(scope="session")
def forkserver(tmp_path_factory):
    """The address for ``launch.environment(tmp, forkserver)``; ``OSLO_FAULT_FORKSERVER=0``: fresh interpreters."""
    if os.environ.get(forkserver_module.ENV) == "0":
        yield "0"
        return
    with launch.ForkServer(tmp_path_factory.mktemp("forkserver")) as address:
        yield address


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    import oslo_models as om

    folder = tmp_path_factory.mktemp("fault_corpus")
    sys.path.insert(0, examples.EXAMPLES)
    try:
        import train_clm

        train_clm.train_tokenizer(examples.CORPUS, str(folder / "tokenizer"), 512)  # the examples' default
    finally:
        sys.path.remove(examples.EXAMPLES)
        for name in ("train_clm", "_common", "_data", "_report"):  # none left bound to another's copy
            sys.modules.pop(name, None)
    om.data.preprocess(examples.CORPUS, str(folder / "corpus"), str(folder / "tokenizer"), show_progress=False)
    return {"data": str(folder / "corpus"), "tokenizer": str(folder / "tokenizer")}
