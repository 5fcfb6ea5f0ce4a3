"""The dashboard's GPU-memory tile (gateway/front/dashboard.html, showMemory), rendered by the page's
own script in Node against a stub DOM: hidden for split pairs, and for a turns pair the holder,
the phase and step, the turns, the requests waiting and the last failure, as /admin/state
says them. (The browser test, tests/test_dashboard.py, needs Chromium; this needs only Node.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

NODE = shutil.which("node")
PAGE = Path(__file__).parents[2] / "gateway" / "front" / "dashboard.html"
pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node (node on PATH)")

HARNESS = """
const elements = {};
const document = { getElementById: (id) => (elements[id] ??= { id, textContent: "", className: "",
                                                                 hidden: false }) };
const window = { addEventListener: () => {} };
const fetch = () => new Promise(() => {});  // the page's poll never answers here
const setTimeout = () => {};
%s
showMemory(%s);
process.stdout.write(JSON.stringify(elements));
"""


def render(state: dict[str, Any]) -> dict[str, Any]:
    script = re.search(r"<script>(.*)</script>", PAGE.read_text(encoding="utf-8"), re.S)
    assert script is not None
    assert NODE is not None
    out = subprocess.run([NODE, "-e", HARNESS % (script.group(1), json.dumps(state))],
                         capture_output=True, text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def memory(**fields: Any) -> dict[str, Any]:
    return {"phase": "holding", "holder": "mtp", "step": None, "turns": 0, "stuck": None,
            "last_failure": None, **fields}


def test_hidden_while_every_pair_splits():
    shown = render({"pairs": [{"name": "default", "memory": {"phase": "split"}}]})
    assert shown["memory-tile"]["hidden"] is True


def test_a_turn_in_progress_shows_its_step_and_the_waiting():
    shown = render({"memory_turn_waiting": 7, "pairs": [{"name": "default", "memory": memory(
        phase="handing", holder="mtp", step="release(mtp)", turns=3)}]})
    assert shown["memory-tile"]["hidden"] is False
    assert shown["memory-holder"]["textContent"] == "mtp"
    assert shown["memory-holder"]["className"] == "value mode-mtp"
    assert shown["memory-phase"]["textContent"] == "handing"
    assert shown["memory-step"]["textContent"] == " at release(mtp)"
    assert shown["memory-turns"]["textContent"] == 3
    assert shown["memory-waiting"]["textContent"] == 7
    assert shown["memory-failure"]["textContent"] == ""


def test_neither_holding_and_stuck_is_said_in_red():
    shown = render({"pairs": [
        {"name": "a", "memory": {"phase": "split"}},
        {"name": "b", "memory": memory(phase="stuck", holder=None, stuck="no server can take it",
                                       last_failure={"step": "resume(plain)", "kind": "timeout",
                                                     "detail": "x", "ago_s": 2.4})}]})
    assert shown["memory-pair"]["textContent"] == " (pair b)"
    assert shown["memory-holder"]["textContent"] == "none"
    assert shown["memory-holder"]["className"] == "value err"
    assert shown["memory-failure"]["textContent"] == "stuck: no server can take it"


def test_the_last_failure_is_shown_after_the_pair_settled():
    shown = render({"pairs": [{"name": "default", "memory": memory(
        holder="plain", turns=1, last_failure={"step": "release(mtp)", "kind": "error",
                                               "detail": "x", "ago_s": 12.2})}]})
    assert shown["memory-failure"]["textContent"] == "last failure: release(mtp) error (12 s ago)"
