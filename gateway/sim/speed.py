"""The simulator's speed: one name and one meaning in every command and in the Python API.

``speed`` is simulated seconds per real second: ``--speed 20`` runs the simulated GPU 20x
faster than the modelled one, ``--speed 1`` in real time. `demo`, `sim` and `lab/scripts/soak.py`
run the simulator at it; `bench` and `calibrate` are told it so they report simulated seconds.
The old ``--time-scale`` (real seconds per simulated second, the inverse) is refused with the
equivalent ``--speed``: its help texts had said both meanings.
"""

from __future__ import annotations

import argparse

SPEED_MEANING = ("simulated seconds per real second: 20 = 20x faster than the modelled GPU, "
                 "1 = real time")


def positive_speed(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number ({SPEED_MEANING}), not {text!r}")
    return value


def time_scale_hint(text: str) -> str:
    """What to say to someone who passed the old ``--time-scale TEXT``."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    instead = f"use --speed {1 / value:g}" if 0 < value < float("inf") else "use --speed"
    return (f"--time-scale was replaced by --speed ({SPEED_MEANING}); "
            f"{instead} for the run --time-scale {text} gave")


class _RefuseTimeScale(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        parser.error(time_scale_hint(str(values)))


def add_speed_argument(parser: argparse.ArgumentParser, default: float = 1.0, *,
                       reported: bool = False) -> None:
    """``--speed`` (and the refused ``--time-scale``). ``reported``: the command does not run
    the simulator but measures one, and needs its speed to report simulated seconds."""
    why = ("; give the --speed the simulated servers were started with, so times are reported "
           "in simulated seconds (1 for real servers)" if reported else "")
    parser.add_argument("--speed", type=positive_speed, default=default, metavar="X",
                        help=f"{SPEED_MEANING} (default %(default)g){why}")
    parser.add_argument("--time-scale", action=_RefuseTimeScale, help=argparse.SUPPRESS)
