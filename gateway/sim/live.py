"""Real time: drives one :class:`~gateway.sim.engine.Engine` on the event loop.

Each step sleeps ``step.duration_s * slow_factor / speed`` seconds while holding the device
lock, so ``speed=20`` runs the model 20x faster than the real GPU would (tests use 10-50;
gateway/sim/speed.py), and two engines that share one :class:`Device` take turns, as on one GPU.
Steps are scheduled on the simulated clock, not on when this task next gets the CPU: a step
starts when the device was free and the work was there, so a wake-up that comes late (a loaded
machine, a busy event loop) is paid back by the next steps' shorter sleeps and tokens/s holds,
up to ``MAX_LAG_S`` behind schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from gateway.sim.engine import Engine, Output, QueueFullError, Request
from gateway.sim.faults import FaultState
from gateway.sim.speed import SPEED_MEANING

# How far behind its schedule a device may fall and still catch up (wall seconds): a process
# stopped for longer (a debugger, a suspended VM) resumes at real speed rather than in a burst.
MAX_LAG_S = 0.5


class Device:
    """One simulated GPU: a FIFO lock (asyncio.Lock hands over in order), its own clock, and,
    when ``capacity_gib`` is given (the turns shape), who holds how much of its memory (per GPU
    of the node, GiB): the ledger the memory saver's resume checks, one owner per server."""

    def __init__(self, capacity_gib: float | None = None) -> None:
        self.lock = asyncio.Lock()
        self.free_at = 0.0  # loop time the last step was due to end
        self.capacity_gib = capacity_gib
        self.held_gib: dict[str, dict[str, float]] = {}  # server -> part -> GiB

    @property
    def free_gib(self) -> float:
        if self.capacity_gib is None:
            return float("inf")
        return self.capacity_gib - sum(sum(parts.values()) for parts in self.held_gib.values())

    def fits(self, gib: float) -> bool:
        return gib <= self.free_gib + 1e-9

    def hold(self, owner: str, part: str, gib: float) -> None:
        self.held_gib.setdefault(owner, {})[part] = gib

    def free(self, owner: str, part: str) -> None:
        self.held_gib.get(owner, {}).pop(part, None)

    def drop(self, owner: str) -> None:
        """A process that exits gives all its memory back to the driver."""
        self.held_gib.pop(owner, None)

    def holding(self, owner: str) -> float:
        return sum(self.held_gib.get(owner, {}).values())


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
        # The scheduler is one thread: a step and a control request (a release, a resume) never
        # overlap. The memory saver takes this lock for its operations.
        self.scheduler = asyncio.Lock()
        # Requests that arrived while the tokenizer is paused (tokenizer_manager.py:938-939):
        # registered, not yet sent to the scheduler; they go in order at continue_generation.
        self.holding_new = False
        self._held: list[Request] = []
        # Asked before each step: a reason the step kills the server (its memory is released),
        # or None. The server dies by ``on_crash(reason)``, and this engine steps no more.
        self.step_crash: Callable[[], str | None] = lambda: None
        self.on_crash: Callable[[str], None] = lambda reason: None
        self.halted = False  # the scheduler died or hangs: no step ever again
        # Loop time of the last output a step delivered (the tokenizer's last_receive_tstamp,
        # which /health reads).
        self.last_output_at = float("-inf")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for rid in self.engine.abort(abort_all=True):
            self._put(Output(rid, 0, finish_reason="abort"))
        for request in list(self._held):
            self._drop_held(request.rid)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: Request) -> asyncio.Queue[Output]:
        """Queue a request; its outputs arrive on the returned queue, the last one finishing it.
        Raises QueueFullError or ValueError as Engine.submit does. While the tokenizer is paused
        the request waits in front of the scheduler (held) and reaches it at ``release_held``."""
        if self.holding_new:
            if request.rid in self.engine or request.rid in self._queues:
                raise ValueError(f"Duplicate request ID: {request.rid}")
            self._held.append(request)
            return self._queue_for(request.rid)
        self.engine.submit(request)
        queue = self._queue_for(request.rid)
        if self._work_since is None:
            self._work_since = asyncio.get_running_loop().time()
        self._wake.set()
        return queue

    def _queue_for(self, rid: str) -> asyncio.Queue[Output]:
        queue: asyncio.Queue[Output] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release_held(self) -> None:
        """``continue_generation``: the requests that waited in the tokenizer go to the
        scheduler in arrival order; one the queue cannot take ends as an abort."""
        self.holding_new = False
        held, self._held = self._held, []
        for request in held:
            try:
                self.engine.submit(request)
            except (QueueFullError, ValueError):
                self._put(Output(request.rid, 0, finish_reason="abort"))
        if held:
            self._kick()

    def _kick(self) -> None:
        if self._work_since is None:
            self._work_since = asyncio.get_running_loop().time()
        self._wake.set()

    def _drop_held(self, rid: str) -> bool:
        """A held request whose handler is gone (its coroutine cancelled in the pause wait)."""
        for request in self._held:
            if request.rid == rid:
                self._held.remove(request)
                self._put(Output(rid, 0, finish_reason="abort"))
                return True
        return False

    def halt(self) -> None:
        """The scheduler is gone (dead or hung): no step ever again, nothing answered."""
        self.halted = True
        self._wake.set()

    def abort(self, rid: str = "", abort_all: bool = False, *, exact: bool = False) -> list[str]:
        """``/abort_request``: free at once; open streams end with finish_reason "abort". A held
        request is not in the scheduler, so only the simulator's own exact abort reaches it."""
        if exact and self._drop_held(rid):
            return [rid]
        aborted = self.engine.abort(rid, abort_all, exact=exact)
        for r in aborted:
            self._put(Output(r, 0, finish_reason="abort"))
        return aborted

    def disconnect(self, rid: str) -> None:
        """SGLang's tokenizer noticed the client is gone and sent the abort (when it notices is
        the HTTP layer's business, see app.py): a queued request leaves now, a running one is
        freed at the end of the step in flight (scheduler.py abort_request)."""
        if self._drop_held(rid):
            return
        if rid in self._queues and self.engine.abort_after_next_step(rid):
            self._put(Output(rid, 0, finish_reason="abort"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.halted:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # requests arriving in the same tick join this step
            async with self.scheduler:
                await self._step(loop)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.halted:
            return
        async with self._device.lock:
            step = self.engine.begin_step()
            if step is None:
                self._work_since = None
                return
            crash = self.step_crash()
            if crash is not None:
                self.halted = True
                self.on_crash(crash)
                return
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
        if outputs:
            self.last_output_at = loop.time()
        for output in outputs:
            self._put(output)
        if self.engine.has_work:
            self._wake.set()

    def wake(self) -> None:
        """Look for work again (after the engine was un-paused)."""
        self._kick()

    def _put(self, output: Output) -> None:
        queue = self._queues.get(output.rid)
        if queue is None:
            return
        if output.finish_reason is not None:
            del self._queues[output.rid]
        queue.put_nowait(output)
