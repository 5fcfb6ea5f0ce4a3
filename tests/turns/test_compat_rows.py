"""Every test docs/compat.md's memory-saver table names in its Gateway column exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_gateway_column_names_tests_that_exist():
    text = (ROOT / "docs" / "compat.md").read_text(encoding="utf-8")
    table = text.split("## The memory saver (turns)")[1].split("\n## ")[0]
    named = []
    for row in table.splitlines():
        if row.startswith("| ") and not row.startswith("| Behaviour"):
            gateway = row.rsplit("|", 2)[-2]
            named += re.findall(r"(tests/[\w/]+\.py)::(\w+)", gateway)
    assert len(named) >= 10
    for path, name in named:
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{path}::{name}"
