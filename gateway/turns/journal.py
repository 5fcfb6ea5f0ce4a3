"""What survives a gateway restart of each turns pair's memory state: each server's memory and
the step in doubt, in one JSON file rewritten whole (atomically) on every change, so that a
gateway restarted mid-turn reads what was in doubt."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from gateway.config import ROLES, EngineName, Role
from gateway.turns.state import MEMORIES, Memory, PairMemory, initial

log = logging.getLogger("mtp_gateway.turns")


def journal(state: PairMemory) -> dict[str, object]:
    """What survives a gateway restart: each server's memory, and the step in doubt."""
    step = state.step
    return {"memory": dict(state.memory), "phase": state.phase,
            "step": None if step is None else str(step)}


def from_journal(data: object, now: float, engine: EngineName = "sglang") -> PairMemory:
    """The state after a restart, from a journal (anything unreadable: nothing known)."""
    memory = data.get("memory") if isinstance(data, dict) else None
    known: dict[Role, Memory] = {}
    if isinstance(memory, dict):
        for role in ROLES:
            value = memory.get(role)
            if value in MEMORIES:
                known[role] = value
    return initial(now, known, engine)


class Journal:
    """Each turns pair's memory, in one JSON file (None: kept in memory only)."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._pairs: dict[str, object] = {}
        if self.path is not None and self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                self._pairs = dict(data.get("pairs", {}))
            except (OSError, ValueError, AttributeError, TypeError):
                log.error("turns journal %s unreadable: starting with nothing known", self.path)

    def read(self, pair: str) -> object:
        return self._pairs.get(pair)

    def write(self, pair: str, state: PairMemory) -> None:
        self._pairs[pair] = journal(state)
        if self.path is None:
            return
        temporary = self.path.with_suffix(self.path.suffix + ".tmp")
        temporary.write_text(json.dumps({"pairs": self._pairs}), encoding="utf-8")
        os.replace(temporary, self.path)
