"""docs/options.md is what ``examples/_options.py`` renders from the scripts' own parsers (no option goes
undocumented, no documented option is gone), and every option it lists parses."""
from __future__ import annotations

import re
import sys

from tests.docs.test_code_blocks import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import _options  # noqa: E402  (the examples' folder is their import root, as when the scripts run)


def test_options_page_is_current():
    page = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    assert page == _options.render(), "regenerate: python examples/_options.py --write docs/options.md"


def test_the_page_lists_every_option_of_every_script():
    page = _options.render()
    listed = set(re.findall(r"^\| `(--[\w-]+)`", page, re.M))
    for script in _options.SCRIPTS:
        flags = {flag for action in _options._options(_options._parser(script)) for flag in action.option_strings}
        assert flags <= listed | {"-h", "--help"}, (script, sorted(flags - listed))
