"""`memory: auto`: which shape a pair runs in, from what its two servers report.

A turns pair needs the engine's hand-over on both servers: SGLang's memory saver, or vLLM's
sleep mode with its dev-mode endpoints. A release (a sleep) on a server without it frees
nothing, and the other's resume then hangs (a wake fails): docs/turns.md. So `auto` is turns
only where both servers say it is on in `/server_info` (SGLang's `enable_memory_saver`, vLLM's
`model_config.enable_sleep_mode`, which only a dev-mode server serves), and split as soon as one
says otherwise (off, no dev mode, or an engine that does not say); while a server has not
answered and the other is on, the shape waits for it. `split` and `turns` in the configuration
force their shape. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gateway.config import ROLES, EngineName, MemorySetting, MemoryShape, Role
from gateway.upstream.engine.probe import SaverReport


@dataclass(frozen=True, slots=True)
class Needs:
    """What an engine's server needs to take turns, in the words of its flags."""

    flag: str  # the launch flag
    field: str  # where /server_info says it
    both: str  # why auto took turns
    controls: str  # why a server without its control endpoints cannot


NEEDS: dict[EngineName, Needs] = {
    "sglang": Needs("--enable-memory-saver", "enable_memory_saver",
                    "both servers run with --enable-memory-saver",
                    "does not say enable_memory_saver in /server_info"),
    "vllm": Needs("--enable-sleep-mode", "model_config.enable_sleep_mode",
                  "both servers run with --enable-sleep-mode in dev mode",
                  "serves no /server_info: it runs without VLLM_SERVER_DEV_MODE=1, so no /sleep "
                  "or /wake_up either"),
}


@dataclass(frozen=True, slots=True)
class ShapeChoice:
    setting: MemorySetting
    shape: MemoryShape | None  # None: not decided yet
    reason: str

    def describe(self) -> dict[str, str | None]:
        """For /admin/state."""
        return {"setting": self.setting, "shape": self.shape, "reason": self.reason}


def choose_shape(setting: MemorySetting, reports: Mapping[Role, SaverReport],
                 engine: EngineName = "sglang") -> ShapeChoice:
    """The pair's shape: the configured one, or auto's from both servers' reports."""
    if setting != "auto":
        return ShapeChoice(setting, setting, f"memory: {setting} in the configuration")
    needs = NEEDS[engine]
    why_not = {"off": f"runs without {needs.flag}",
               "unsaid": f"does not say {needs.field} in /server_info",
               "no_controls": needs.controls}
    cannot = [f"{role} {why_not[reports[role]]}" for role in ROLES if reports[role] in why_not]
    if cannot:
        return ShapeChoice(setting, "split", "auto: " + "; ".join(cannot))
    silent = [role for role in ROLES if reports[role] == "silent"]
    if silent:
        return ShapeChoice(setting, None, f"auto: waiting for {' and '.join(silent)} to answer "
                           f"/server_info (turns needs {needs.flag} on both servers)")
    return ShapeChoice(setting, "turns", f"auto: {needs.both}")
