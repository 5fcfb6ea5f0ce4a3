"""Real time: drives one :class:`~gateway.sim.engine.Engine` on the event loop.

Each step sleeps ``step.duration_s * slow_factor / speed`` seconds while holding the device
lock, so ``speed=20`` runs the model 20x faster than the real GPU would (tests use 10-50;
gateway/speed.py), and two engines that share one :class:`Device` take turns, as on one GPU.
Steps are scheduled on the simulated clock, not on when this task next gets the CPU: a step
starts when the device was free and the work was there, so a wake-up that comes late (a loaded
machine, a busy event loop) is paid back by the next steps' shorter sleeps and tokens/s holds,
up to ``MAX_LAG_S`` behind schedule.
"""

from __future__ import annotations

import asyncio
import contextlib

from gateway.sim.engine import Engine, Output, Request
from gateway.sim.faults import FaultState
from gateway.speed import SPEED_MEANING

# How far behind its schedule a device may fall and still catch up (wall seconds): a process
# stopped for longer (a debugger, a suspended VM) resumes at real speed rather than in a burst.
MAX_LAG_S = 0.5


class Device:
    """One simulated GPU: a FIFO lock (asyncio.Lock hands over in order) and its own clock."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.free_at = 0.0  # loop time the last step was due to end


class LiveEngine:
    """An engine stepping in (scaled) real time, delivering outputs to per-request queues."""

    def __init__(
        self, engine: Engine, device: Device, speed: float, faults: FaultState
    ) -> None:
        if not 0 < speed < float("inf"):
            raise ValueError(f"speed must be a positive number ({SPEED_MEANING}), not {speed}")
        self.engine = engine
        self.speed = speed  # simulated seconds per real second
        self._device = device
        self._faults = faults
        self._queues: dict[str, asyncio.Queue[Output]] = {}
        self._wake = asyncio.Event()
        self._work_since: float | None = None  # loop time since when work waits for a step
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for rid in self.engine.abort(abort_all=True):
            self._put(Output(rid, 0, finish_reason="abort"))
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: Request) -> asyncio.Queue[Output]:
        """Queue a request; its outputs arrive on the returned queue, the last one finishing it.
        Raises QueueFullError or ValueError as Engine.submit does."""
        self.engine.submit(request)
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._queues[request.rid] = queue
        if self._work_since is None:
            self._work_since = asyncio.get_running_loop().time()
        self._wake.set()
        return queue

    def abort(self, rid: str = "", abort_all: bool = False, *, exact: bool = False) -> list[str]:
        """``/abort_request``: free at once; open streams end with finish_reason "abort"."""
        aborted = self.engine.abort(rid, abort_all, exact=exact)
        for r in aborted:
            self._put(Output(r, 0, finish_reason="abort"))
        return aborted

    def disconnect(self, rid: str) -> None:
        """SGLang's tokenizer noticed the client is gone and sent the abort (when it notices is
        the HTTP layer's business, see app.py): a queued request leaves now, a running one is
        freed at the end of the step in flight (scheduler.py abort_request)."""
        if rid in self._queues and self.engine.abort_after_next_step(rid):
            self._put(Output(rid, 0, finish_reason="abort"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # requests arriving in the same tick join this step
            async with self._device.lock:
                step = self.engine.begin_step()
                if step is None:
                    self._work_since = None
                    continue
                scale = self._faults.faults.slow_factor / self.speed
                now = loop.time()
                ready = now if self._work_since is None else self._work_since
                # When the device was free and the work was there, not when this task got the
                # CPU: oversleeping is paid back, and after idle time the step starts at once.
                start = max(ready, self._device.free_at, now - MAX_LAG_S)
                due = start + step.duration_s * scale
                await asyncio.sleep(due - loop.time())
                self._device.free_at = due
                outputs = self.engine.finish_step(step)
                self._work_since = due if self.engine.has_work else None
            for output in outputs:
                self._put(output)
            if self.engine.has_work:
                self._wake.set()

    def _put(self, output: Output) -> None:
        queue = self._queues.get(output.rid)
        if queue is None:
            return
        if output.finish_reason is not None:
            del self._queues[output.rid]
        queue.put_nowait(output)
