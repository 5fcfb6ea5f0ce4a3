"""vLLM 0.33.0's sleep mode in one simulated server: ``/sleep``, ``/wake_up``, ``/is_sleeping``.

What the source does (under ``vllm/``; docs/compat.md's vLLM section has a row and a test each):

- ``sleep(level, mode)`` pauses the scheduler first (v1/engine/core.py:993-1028): every mode
  queues new requests; ``abort`` finishes every running and waiting request aborted
  (:976-977), ``wait`` lets the running ones step to their end before it goes on, ``keep``
  freezes them, and at level >= 1 the cache reset preempts them back to waiting: they are
  computed again after the wake. Level 1 copies the weights (target and MTP draft) to pinned
  host memory, allocated at each sleep and dropped at each wake
  (device_allocator/cumem.py:255-298, :355-360), and discards the KV cache; level 2 discards
  the weights too (the draft is lost: vLLM issue #52479). A sleep while asleep changes nothing
  ("Executor is already sleeping.", v1/executor/abstract.py:400-403).
- ``wake_up(tags)`` maps the memory back (:412-435): a wake while awake changes nothing but
  resumes the scheduler; one that does not fit beside the other process fails in cuMemCreate,
  and the engine core answers the failure (core.py:1848-1851) as a 500; the executor is still
  asleep (its tags are cleared only after the call succeeds). The scheduler resumes only once
  nothing is asleep (core.py:1031-1056).
- ``/health`` says nothing of it: 200 while asleep (v1/engine/async_llm.py:1129-1134).
- Without ``--enable-sleep-mode`` the endpoints answer the same (dev mode is what serves them)
  but nothing was allocated in the cuMem pools (v1/worker/gpu_worker.py:396-417, the allocator
  forced on only by sleep mode, config/model.py:666-673): a sleep frees nothing and a wake
  maps nothing back (SaverOptions.enable_memory_saver off).

What it costs is the SGLang simulator's measured copy model (gateway/sim/saver.py): a host
buffer allocated at every sleep, copied over the host link, given back at every wake.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.sim.live import Device, LiveEngine
from gateway.sim.saver import KV_CACHE, WEIGHTS, Footprint, SaverOptions, pause_cost_s, resume_cost_s

PAUSE_MODES = ("abort", "wait", "keep")  # v1/engine/__init__.py:33 PauseMode
SLEEP_TAGS = (WEIGHTS, KV_CACHE)  # v1/executor/abstract.py:36
# How often a ``wait`` sleep looks whether the running requests are done (real seconds).
DRAIN_POLL_S = 0.005
# What the failed cuMemCreate says: the text is the compiled allocator's, not in vLLM's Python
# source; the simulator names the cause.
WAKE_OOM = "Call to wake_up method failed: CUDA Error: out of memory"


def sleep_cost_s(footprint: Footprint, options: SaverOptions, level: int) -> float:
    """Simulated seconds a sleep at ``level`` (1 or 2) takes: the weights copied to a fresh
    host buffer (level 1) or dropped (level 2), the KV cache dropped."""
    return sum(pause_cost_s(tag, footprint.region_gib(tag), options, False, tag == WEIGHTS and level == 1)
               for tag in SLEEP_TAGS)


def wake_cost_s(footprint: Footprint, options: SaverOptions, level: int,
                tags: tuple[str, ...] = SLEEP_TAGS) -> float:
    """Simulated seconds a wake of ``tags`` after a sleep at ``level`` takes."""
    return sum(resume_cost_s(tag, footprint.region_gib(tag), options, tag == WEIGHTS and level == 1)
               for tag in tags)


def costs(hardware: str = "h200") -> dict[str, tuple[float, float]]:
    """(sleep, wake) seconds at level 1 of each server of a vLLM turns pair on ``hardware``."""
    from gateway.sim import memory
    from gateway.sim.saver import footprint_of
    from gateway.sim.server import SimOptions

    options = SimOptions(engine="vllm", memory="turns", hardware=hardware)
    saver = options.resolved_saver()
    result = {}
    for name, sizing in options.sizings().items():
        footprint = footprint_of(name, sizing, memory.HARDWARE[hardware])
        sleep, wake = sleep_cost_s(footprint, saver, 1), wake_cost_s(footprint, saver, 1)
        result[name] = (round(sleep, 2), round(wake, 2))
    return result


class WakeFailed(Exception):
    """A wake-up the device cannot hold: the engine core's failure message (a 500)."""


@dataclass
class SleepState:
    level: int | None = None  # the level of the last sleep, None when awake
    scheduler_paused: bool = False
    sleeping_tags: frozenset[str] = frozenset()  # the executor's (v1/executor/abstract.py:121)

    @property
    def is_sleeping(self) -> bool:
        """core.py:1078-1080: paused at any level, or memory asleep."""
        return self.scheduler_paused or bool(self.sleeping_tags)


class SleepMode:
    """The sleep mode of one simulated vLLM server, on the shared device's ledger."""

    def __init__(self, name: str, live: LiveEngine, device: Device, footprint: Footprint,
                 options: SaverOptions) -> None:  # fmt: skip
        self.name = name
        self.live = live
        self.device = device
        self.footprint = footprint
        self.options = options
        self.state = SleepState()

    async def sleep(self, level: int, mode: str) -> None:
        """Returns when vLLM answers ``/sleep``."""
        self._pause_scheduler(mode, clear_cache=level >= 1)
        if mode == "wait":
            while self.live.engine.has_work:
                await asyncio.sleep(DRAIN_POLL_S)
            self.live.engine.paused = True
        if level < 1 or WEIGHTS in self.state.sleeping_tags:
            self.state.level = level if self.state.level is None else self.state.level
            return  # level 0 pauses only; asleep already: "Executor is already sleeping."
        async with self.live.scheduler:
            await self._sleep(sleep_cost_s(self.footprint, self.options, level))
            for tag in SLEEP_TAGS if self.options.enable_memory_saver else ():  # else nothing to unmap
                self.device.free(self.name, tag)
            self.state.sleeping_tags = frozenset(SLEEP_TAGS)
            self.state.level = level

    def _pause_scheduler(self, mode: str, clear_cache: bool) -> None:
        """core.py:955-983: every mode queues new requests (they wait in front of the
        scheduler, counted as waiting); abort finishes all, keep freezes the running ones."""
        engine = self.live.engine
        self.state.scheduler_paused = True
        self.live.holding_new = True
        if mode == "abort":
            self.live.abort(abort_all=True)
        if mode != "wait":
            engine.paused = True
        if mode == "keep" and clear_cache:
            engine.retract()  # preempted back to waiting (v1/core/sched/scheduler.py:3194-3210)
        if clear_cache:
            engine.flush_cache()

    async def wake_up(self, tags: tuple[str, ...] | None) -> bool:
        """``/wake_up``: whether the server is fully awake. Raises WakeFailed."""
        wanted = tuple(t for t in (tags or SLEEP_TAGS) if t != "scheduling")
        asleep = [t for t in SLEEP_TAGS if t in wanted and t in self.state.sleeping_tags]
        if tags is not None and not wanted and "scheduling" not in tags:
            asleep = []
        async with self.live.scheduler:
            mapped = asleep if self.options.enable_memory_saver else []  # without sleep mode: never unmapped
            need = sum(self.footprint.region_gib(tag) for tag in mapped)
            if mapped and not self.device.fits(need):
                raise WakeFailed(WAKE_OOM)
            for tag in mapped:
                self.device.hold(self.name, tag, self.footprint.region_gib(tag))
            await self._sleep(wake_cost_s(self.footprint, self.options, self.state.level or 1, tuple(asleep)))
            if WEIGHTS in asleep and self.state.level == 2 and self.live.engine.profile.speculative:
                self.live.engine.drafts_broken = True  # reload_weights reloads the target only
            self.state.sleeping_tags = self.state.sleeping_tags - set(asleep)
        if self.state.sleeping_tags:
            return False  # partial wakes keep the scheduler paused (core.py:1050-1055)
        self._resume_scheduler()
        return True

    def _resume_scheduler(self) -> None:
        self.state.scheduler_paused = False
        self.state.level = None
        self.live.engine.paused = False
        self.live.release_held()
        self.live.wake()

    def sleep_state(self) -> dict[str, int]:
        """vllm:engine_sleep_state's three values (v1/metrics/loggers.py:593-615)."""
        level = self.state.level if self.state.sleeping_tags else None
        return {"awake": int(level is None), "weights_offloaded": int(level == 1),
                "discard_all": int(level == 2)}  # fmt: skip

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds / self.live.speed)
