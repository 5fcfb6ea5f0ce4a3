"""The I/O of each step of a turn or a settling (the steps are gateway/turns/state.py's): the
engine's hand-over calls (SGLang's memory saver, vLLM's sleep mode: the pair's `controls`),
the relay's stream moves and ends, the NVML memory check and the checks of the incoming
server. One `StepCalls` per pair, used by its driver (gateway/turns/driver.py)
one step at a time; a step that fails raises CallFailed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from gateway.routing.backend import BackendState
from gateway.turns import nvml
from gateway.turns.handles import PairHandles
from gateway.turns.state import Step, other
from gateway.upstream.engine.probe import CallFailed
from gateway.upstream.engine.seam import Control
from gateway.upstream.engine.sglang import MemorySaver
from gateway.upstream.engine.vllm import SleepControl

log = logging.getLogger("mtp_gateway.turns")
Calls = TypeVar("Calls", MemorySaver, SleepControl)

TICK_S = 0.05  # how often a driver looks at what its pair wants, and at draining streams


class StepCalls:
    def __init__(self, pair: PairHandles,
                 free_fractions: Callable[[], list[float] | None] = nvml.free_fractions) -> None:
        self.pair = pair
        self.free_fractions = free_fractions
        self._nvml_seen: bool | None = None

    async def do(self, step: Step) -> None:
        pair = self.pair
        turns, saver = pair.turns, pair.controls[step.role]
        source, target = pair.backends[step.role], pair.backends[other(step.role)]
        match step.action:
            case "stop_admitting":
                pass  # the phase did it: admitting is None from the turn's start
            case "move_unstarted":
                moved = pair.streams.move_all_unstarted(source, target)
                if moved:
                    log.info("pair %s: %d unstarted streams moved %s -> %s", pair.name, moved,
                             source.name, target.name)
            case "end_streams":
                ended = pair.streams.end_running(source, "memory_turn")
                if ended:
                    log.warning("pair %s: %d streams waiting on %s, which does not hold the "
                                "memory, ended with an error", pair.name, ended, source.name)
            case "running_streams":
                await self._continue_running(source, target)
                await self._running_streams(source)
            case "finish_streams":
                await self._running_streams(source)
            case "keep_caches":
                await self._keep_caches(_calls(saver, MemorySaver, step))
            case "pause":
                await _calls(saver, MemorySaver, step).pause(turns.call_timeout_s)
            case "release":
                await _calls(saver, MemorySaver, step).release(turns.release_timeout_s)
            case "sleep":
                await _calls(saver, SleepControl, step).sleep(turns.release_timeout_s)
            case "check_memory":
                await self._check_memory()
            case "resume":
                await _calls(saver, MemorySaver, step).resume(turns.resume_timeout_s)
            case "wake_up":
                await _calls(saver, SleepControl, step).wake_up(turns.resume_timeout_s)
            case "continue":
                await _calls(saver, MemorySaver, step).continue_generation(turns.call_timeout_s)
            case "check_ready":
                await self._until(lambda: saver.ready(turns.call_timeout_s), turns.ready_within_s,
                                  f"{saver.name} not ready within {turns.ready_within_s:g} s")
            case "check_speculation":
                await self._check_speculation(saver)

    async def _continue_running(self, source: BackendState, target: BackendState) -> None:
        """Running streams that can be continued go on on the incoming server. It is paused:
        their continuations wait in its tokenizer and their first events come after its
        resume, so this does not wait for them (timeout 0); each leaves `source` at once."""
        if not source.inflight:
            return
        result = await self.pair.streams.continue_running(source, target, timeout_s=0)
        staying = sum(getattr(result, "staying", {}).values())
        log.info("pair %s: running streams on %s handed to %s (%d staying: %s)", self.pair.name,
                 source.name, target.name, staying, getattr(result, "staying", {}))

    async def _running_streams(self, source: BackendState) -> None:
        """Running streams finish first within `finish_within_s`, this gateway's and (by the
        server's own count, /v1/loads) the replicas' that follow it; this gateway's left then
        end with an error in their API's shape (a hand-off continues them on the other server,
        once wired). The followers end theirs at the same bound (gateway/turns/follow.py)."""
        pair = self.pair
        turns, clock = pair.turns, pair.clock
        deadline = clock() + turns.finish_within_s
        while source.inflight and clock() < deadline:
            await asyncio.sleep(TICK_S)
        saver = pair.controls[source.role]
        while not source.inflight and clock() < deadline:  # other replicas' streams
            busy = await saver.busy(turns.call_timeout_s)
            if not busy:  # none left (or no /v1/loads to tell)
                break
            await asyncio.sleep(TICK_S)
        if source.inflight:
            ended = pair.streams.end_running(source, "memory_turn")
            log.warning("pair %s: %d streams on %s did not finish within %g s: ended with an "
                        "error", pair.name, ended, source.name, turns.finish_within_s)
            deadline = clock() + turns.call_timeout_s
            while source.inflight and clock() < deadline:
                await asyncio.sleep(TICK_S)

    async def _keep_caches(self, saver: MemorySaver) -> None:
        """The outgoing server, idle and not paused, writes its prefix cache to its store: wait
        until its backup counters have not moved for `caches_quiet_s` (its device-to-host
        copies done, its store writes drained), at most `keep_caches_within_s`."""
        turns, clock = self.pair.turns, self.pair.clock
        counts = await saver.cache_backups(turns.call_timeout_s)
        if counts is None:
            return  # no HiCache: nothing to keep
        started = quiet_since = clock()
        while clock() - quiet_since < turns.caches_quiet_s:
            if clock() - started >= turns.keep_caches_within_s:
                log.warning("pair %s: %s still writing its prefix cache after %g s (backed up "
                            "to host %d tokens, to its store %d): paused now, the rest is lost",
                            self.pair.name, saver.name, turns.keep_caches_within_s, *counts)
                return
            await asyncio.sleep(TICK_S)
            now = await saver.cache_backups(turns.call_timeout_s)
            if now is not None and now != counts:
                counts, quiet_since = now, clock()

    async def _check_memory(self) -> None:
        turns, clock = self.pair.turns, self.pair.clock
        if not turns.check_memory:
            return
        minimum = turns.min_free_fraction
        deadline = clock() + turns.call_timeout_s
        while True:
            fractions = self.free_fractions()
            if fractions is None:
                if self._nvml_seen is not False:
                    log.info("pair %s: no GPU visible to NVML here: the memory check is skipped",
                             self.pair.name)
                self._nvml_seen = False
                return
            self._nvml_seen = True
            if all(f >= minimum for f in fractions):
                return
            if clock() >= deadline:
                shown = ", ".join(f"GPU {i}: {f:.0%} free" for i, f in enumerate(fractions))
                raise CallFailed("check", f"the memory did not come back ({shown}; "
                                 f"{minimum:.0%} expected)")
            await asyncio.sleep(TICK_S)

    async def _check_speculation(self, saver: Control) -> None:
        turns = self.pair.turns
        minimum = turns.min_accept_length
        if not minimum:
            return
        accept = await saver.accept_length(turns.ready_within_s)
        if accept is None:
            log.info("pair %s: %s gave no accept length: speculation not checked",
                     self.pair.name, saver.name)
            return
        if accept < minimum:
            raise CallFailed("check", f"{saver.name} accepts {accept:.2f} tokens per step after "
                             f"its resume, < {minimum:g}: its draft weights may have come back "
                             "wrong (sglang #31674)")

    async def _until(self, check: Callable[[], Any], within_s: float, why: str) -> None:
        clock = self.pair.clock
        deadline = clock() + within_s
        while not await check():
            if clock() >= deadline:
                raise CallFailed("timeout", why)
            await asyncio.sleep(TICK_S)


def _calls(control: Control, kind: type[Calls], step: Step) -> Calls:
    """The engine's own calls for `step` (a plan asks only its engine's: gateway/turns/state.py
    HANDOVERS); a step another engine's server cannot take fails as a check, sending nothing."""
    if not isinstance(control, kind):
        raise CallFailed("check", f"{step} is not a call {control.name} takes", sent=False)
    return control
