"""What the gateway learns of one inference server when it probes it, and how a control call to
it fails, in no engine's words: the engine modules report them, the turns state machine
(gateway/turns/state.py) decides on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# How a control call can fail: an error answer, no answer in time, the server gone (connection
# refused or reset), or a check that did not pass.
FailureKind = Literal["error", "timeout", "gone", "check"]

# What one server says of its memory saver, SGLang's or vLLM's sleep mode (the `memory: auto`
# choice, gateway/turns/shape.py): on, off, answered without saying (an engine that has no such
# setting), its control endpoints not served at all (vLLM without dev mode), or no answer yet.
SaverReport = Literal["on", "off", "unsaid", "no_controls", "silent"]


@dataclass(frozen=True, slots=True)
class Probe:
    """One server, probed: /ping 200 (the process serves HTTP), /ready 200 (not paused, takes
    requests), and whether its scheduler answered /server_info in time (it is not stuck in a
    control call: SGLang's scheduler takes control requests in order, so an answer after a
    release or resume was sent means that call has finished)."""

    alive: bool
    ready: bool = False
    scheduler_answers: bool = False
    memory_saver: bool | None = None  # /server_info's enable_memory_saver (None: not said)
    # The server says whether it is asleep, its memory given up (vLLM's /is_sleeping, answered
    # by its engine core after any call sent before it); None: it cannot say (SGLang: a
    # paused server may or may not have released).
    asleep: bool | None = None


class CallFailed(Exception):
    """A control call that did not succeed: how (`kind`), and whether it may have reached
    the server (`sent`: False only when the connection was refused)."""

    def __init__(self, kind: FailureKind, detail: str, *, sent: bool = True) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.sent = sent
