"""Every command that runs or measures the simulator says the same thing about its speed.

Before, `demo` and `lab/scripts/soak.py` said "--time-scale: simulated time per real second" while
`sim`, `bench`, `calibrate` and the code meant the inverse; a user asking `demo` for 20x faster
got 20x slower.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main

ROOT = Path(__file__).resolve().parent.parent
SOAK = [sys.executable, str(ROOT / "lab" / "scripts" / "soak.py")]
COMMANDS = ["demo", "sim", "bench", "calibrate", "soak"]
MEANING = "simulated seconds per real second: 20 = 20x faster than the modelled GPU, 1 = real time"


def _run(command: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    if command == "soak":
        done = subprocess.run(SOAK + args, capture_output=True, text=True, timeout=30)
        return done.returncode, done.stdout, done.stderr
    with pytest.raises(SystemExit) as exited:
        main([command, *args])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def _speed_entry(help_text: str) -> str:
    """The --speed option's entry in argparse's help, line wrapping undone."""
    entry = re.search(r"\n  --speed X\s+(.*?)(?=\n  -|\n\n|\Z)", help_text, re.S)
    assert entry, "no --speed option in:\n" + help_text
    return " ".join(entry.group(1).split())


@pytest.mark.parametrize("command", COMMANDS)
def test_speed_option_means_the_same_in_every_command(command, capsys):
    code, out, _ = _run(command, ["--help"], capsys)
    assert code == 0
    entry = _speed_entry(out)
    default = "4" if command == "soak" else "1"  # the soak runs its backends 4x faster
    assert entry.startswith(f"{MEANING} (default {default})")
    assert "--time-scale" not in out


@pytest.mark.parametrize("command", COMMANDS)
def test_old_time_scale_is_refused_with_the_speed_to_use(command, capsys):
    code, _, err = _run(command, ["--time-scale", "0.05"], capsys)
    assert code == 2
    assert "use --speed 20" in err


@pytest.mark.parametrize("value", ["0", "-3", "fast", "inf"])
def test_speed_must_be_a_positive_number(value, capsys):
    code, _, err = _run("sim", ["--speed", value], capsys)
    assert code == 2 and "--speed" in err and "positive" in err
