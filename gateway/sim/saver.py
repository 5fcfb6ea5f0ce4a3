"""SGLang 0.5.23's memory saver in one simulated server: pause, release, resume, continue.

One module of ~450 lines on purpose: one state machine (pause, release, resume, continue) and
its hard failures, each next to the SGLang line it follows.

What the source does (file:line under sglang/srt/, the 0.5.23 wheel; docs/compat.md has a row
and a test for each):

- ``pause_generation`` (tokenizer_manager.py:2267-2280): the tokenizer stops sending new
  requests to the scheduler (they wait, registered, at :938-939). ``abort`` aborts everything
  and answers once no request is left; ``retract`` and ``in_place`` go to the scheduler without
  waiting for it (scheduler.py:5817-5919): ``in_place`` just stops the steps, ``retract`` also
  puts the running requests back in the waiting queue (their streams stay open and silent).
- ``continue_generation`` (tokenizer_manager.py:2282-2286, scheduler.py:5934-5958): the
  scheduler steps again, the waiting requests reach it.
- ``release_memory_occupation`` (weight_updater.py:337-379) asserts an idle scheduler
  (queued requests allowed only while the scheduler is paused); a failed assertion kills the
  scheduler, and its SIGQUIT the server (scheduler.py:6370-6373). It pauses the ``kv_cache``
  regions and flushes the prefix cache, then ``weights``, then ``cuda_graph``; pausing a paused
  region makes torch_memory_saver exit the process. Answers ``null`` once done.
- ``resume_memory_occupation`` (weight_updater.py:383-422) first removes each tag from the
  released set (a tag not released: KeyError, the scheduler dies), then maps ``cuda_graph``,
  ``weights``, ``kv_cache`` back; a resume that does not fit beside the other process never
  answers (memory-turns.md: cuMemCreate out of memory, the process never answered again).
- Without ``--enable-memory-saver`` the adapter is a no-op (utils/torch_memory_saver_adapter.py
  :139-164): the endpoints still check and flush, but no memory moves.
- A released server that is not paused runs the next request on unmapped memory: an illegal
  access in the forward pass, an exception in the scheduler, SIGQUIT, the server dies.

The simulator's model of the device is the ledger in :class:`gateway.sim.live.Device`; the time
each step costs comes from the H200 probe (memory-turns.md), scaled by bytes and host link.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.sim import memory
from gateway.sim.live import Device, LiveEngine

T = TypeVar("T")

KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
ALL_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # constants.py:6-9 GPU_MEMORY_ALL_TYPES
PAUSE_MODES = ("abort", "retract", "in_place")  # io_struct.py:1946
# The abort-mode pause re-sends abort_all and sleeps 1 s while any request still holds the
# model-update reader lock (tokenizer_manager.py:2273-2280): with requests in flight it answers
# after one such sleep (their aborts land within it), without any at once.
ABORT_PAUSE_POLL_S = 1.0

# --- what one turn costs: the H200 probe (memory-turns.md), 30 GB of weights, 90 GB of KV ---
# torch_memory_saver 0.0.10 on one H200, torch 2.11; a pinned host <-> GPU copy ran at 55 GB/s.
PROBE_WEIGHTS_GB = 30.0
PROBE_KV_GB = 90.0
PROBE_HOST_LINK_GBPS = 55.0
# Host link per GPU by hardware (GB/s, each GPU copies its own shard over its own link). The
# H200 figure is the probe's; the RTX PRO 6000 sits on PCIe 5.0 x16 as the probe's H200 did, so
# the same figure is assumed until measured there.
HOST_LINK_GBPS = {"h200": PROBE_HOST_LINK_GBPS, "rtx-pro-6000": PROBE_HOST_LINK_GBPS}
# Pausing weights with the host copy kept (TMS_RETAIN_CPU_BACKUP=1), 2nd and later: 0.62-0.65 s,
# a device -> host copy at 30 / 0.635 = 47 GB/s, 0.86 of the link.
RETAINED_PAUSE_S = 0.635
PAUSE_LINK_EFFICIENCY = PROBE_WEIGHTS_GB / RETAINED_PAUSE_S / PROBE_HOST_LINK_GBPS
# The first pause (every pause without retention): 11.4-15.0 s, the copy plus allocating the
# host buffer (the VM grew its memory at ~3 s per 8 GiB): what is left after the copy is the
# allocation, 30 GB in 13.2 - 0.635 s = 2.4 GB/s, a host cost the link does not change.
FIRST_PAUSE_S = 13.2
HOST_ALLOCATION_GBPS = PROBE_WEIGHTS_GB / (FIRST_PAUSE_S - RETAINED_PAUSE_S)
# Resuming weights: 0.59 s retained (host -> device at 51 GB/s, 0.92 of the link); 3.3-4.9 s
# without retention, the rest being the host buffer given back: 30 GB in 4.1 - 0.59 s.
RETAINED_RESUME_S = 0.59
RESUME_LINK_EFFICIENCY = PROBE_WEIGHTS_GB / RETAINED_RESUME_S / PROBE_HOST_LINK_GBPS
UNRETAINED_RESUME_S = 4.1
HOST_FREE_GBPS = PROBE_WEIGHTS_GB / (UNRETAINED_RESUME_S - RETAINED_RESUME_S)
# The KV cache is unmapped and mapped again, not copied: 0.04-0.07 s and 0.05-0.09 s for 90 GB,
# by the number of pages, so by bytes. Weights released without a host copy cost the same.
KV_PAUSE_S_PER_GB = 0.055 / PROBE_KV_GB
KV_RESUME_S_PER_GB = 0.07 / PROBE_KV_GB

# What a server holds besides its pools, and what a release leaves, are memory.py's figures
# (START_OVERHEAD_GIB, ATTENTION_AND_LOGITS_BUFFERS_GIB, CUDA_GRAPHS_GIB, ACTIVATIONS_GIB,
# named_buffer_clone_gib), with their sources there.


@dataclass(frozen=True)
class SaverOptions:
    """The server's flags and environment that change the memory saver."""

    enable_memory_saver: bool = False  # --enable-memory-saver
    weights_cpu_backup: bool = False  # --enable-weights-cpu-backup (target and draft)
    draft_weights_cpu_backup: bool = False  # --enable-draft-weights-cpu-backup
    cuda_graph_in_saver: bool = False  # SGLANG_MEMORY_SAVER_CUDA_GRAPH=1
    retain_cpu_backup: bool = False  # TMS_RETAIN_CPU_BACKUP=1 (keep the host copy after a resume)
    host_link_gbps: float = PROBE_HOST_LINK_GBPS


@dataclass(frozen=True)
class Footprint:
    """One server's GPU memory per GPU (GiB), by what a release does with it."""

    weights_gib: float  # target + draft ("weights" regions)
    draft_weights_gib: float  # the draft's part of it
    # The static pools ("kv_cache" regions) and the activations, which the flush of a
    # kv_cache release gives back (memory.ACTIVATIONS_GIB).
    kv_cache_gib: float
    cuda_graph_gib: float = memory.CUDA_GRAPHS_GIB
    # Never released: context, NCCL, custom all-reduce, attention and logits buffers.
    fixed_gib: float = memory.START_OVERHEAD_GIB + memory.ATTENTION_AND_LOGITS_BUFFERS_GIB
    named_buffer_clone_gib: float = memory.named_buffer_clone_gib(memory.HARDWARE[memory.DEFAULT_HARDWARE])

    @classmethod
    def of(cls, sizing: memory.Sizing, draft_weights_gib: float, hardware: memory.Hardware) -> Footprint:
        return cls(sizing.weights_gib, draft_weights_gib, sizing.pool_gib + memory.ACTIVATIONS_GIB,
                   fixed_gib=hardware.start_overhead_gib + memory.ATTENTION_AND_LOGITS_BUFFERS_GIB,
                   named_buffer_clone_gib=memory.named_buffer_clone_gib(hardware))  # fmt: skip

    def region_gib(self, tag: str) -> float:
        return {KV_CACHE: self.kv_cache_gib, WEIGHTS: self.weights_gib, CUDA_GRAPH: self.cuda_graph_gib}[tag]

    @property
    def resident_gib(self) -> float:
        return self.fixed_gib + self.weights_gib + self.kv_cache_gib + self.cuda_graph_gib


def pause_cost_s(tag: str, gib: float, options: SaverOptions, host_buffer_kept: bool,
                 backed_up: bool) -> float:  # fmt: skip
    """Seconds to release ``gib`` (per GPU) of one tag's regions."""
    gb = gib * memory.GIB / memory.GB
    if not options.enable_memory_saver:
        return 0.0
    if tag == KV_CACHE or not backed_up:
        return gb * KV_PAUSE_S_PER_GB
    seconds = gb / (options.host_link_gbps * PAUSE_LINK_EFFICIENCY)
    return seconds if host_buffer_kept else seconds + gb / HOST_ALLOCATION_GBPS


def resume_cost_s(tag: str, gib: float, options: SaverOptions, backed_up: bool) -> float:
    """Seconds to map ``gib`` (per GPU) of one tag back, copying its host copy if it has one."""
    gb = gib * memory.GIB / memory.GB
    if not options.enable_memory_saver:
        return 0.0
    if tag == KV_CACHE or not backed_up:
        return gb * KV_RESUME_S_PER_GB
    seconds = gb / (options.host_link_gbps * RESUME_LINK_EFFICIENCY)
    return seconds if options.retain_cpu_backup else seconds + gb / HOST_FREE_GBPS


# --- sizing in the turns shape: memory.size_turns (the first server sizes on the empty GPUs and
# is parked, the other on what the parked one leaves) ------------------------------------------
TURNS_FIRST = memory.TURNS_FIRST


def turns_sizings(hardware: memory.Hardware, options: SaverOptions) -> dict[str, memory.Sizing]:
    return memory.size_turns(hardware, cuda_graphs_released=options.cuda_graph_in_saver).servers


def footprint_of(role: str, sizing: memory.Sizing, hardware: memory.Hardware) -> Footprint:
    draft = 0.0
    if role != "plain":
        draft = memory.QWEN35_122B.draft_weight_bytes(memory.PAIR_WEIGHTS) / hardware.gpus / memory.GIB
    return Footprint.of(sizing, draft, hardware)


class SaverError(Exception):
    """A request body the endpoint's model refuses (FastAPI's validation: a 400)."""


def parse_tags(body: Any) -> tuple[str, ...]:
    """``{"tags": null | [str]}`` (io_struct.py:2177-2190); none or empty means all."""
    if not isinstance(body, dict):
        raise SaverError("Input should be a valid dictionary or object to extract fields from")
    tags = body.get("tags")
    if tags is None:
        return ALL_TAGS
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise SaverError("tags: Input should be a valid list of strings")
    return tuple(tags) or ALL_TAGS


def parse_mode(body: Any) -> str:
    if not isinstance(body, dict):
        raise SaverError("Input should be a valid dictionary or object to extract fields from")
    mode = body.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise SaverError("mode: Input should be 'abort', 'retract' or 'in_place'")
    return str(mode)


@dataclass
class SaverState:
    """What one server's memory saver knows; ``/sim/state`` shows it (SGLang does not)."""

    status: str = "serving"  # "serving", "dead" (the process exited) or "hung" (never answers)
    cause: str = ""  # why it died or hangs
    tokenizer_paused: bool = False  # new requests wait (tokenizer_manager.py:938)
    released: set[str] = field(default_factory=set)  # offload_tags (weight_updater.py:349)
    paused_regions: set[str] = field(default_factory=set)  # torch_memory_saver's paused tags
    host_buffers: set[str] = field(default_factory=set)  # host copies kept (TMS_RETAIN_CPU_BACKUP)
    weights_garbage: bool = False  # target weights released without a host copy, then resumed

    def view(self) -> dict[str, Any]:
        return {"status": self.status, "cause": self.cause, "paused": self.tokenizer_paused,
                "released": sorted(self.released), "weights_garbage": self.weights_garbage}  # fmt: skip


class MemorySaver:
    """The memory saver of one server; ``on_death`` takes the simulated process down."""

    def __init__(self, name: str, live: LiveEngine, device: Device, footprint: Footprint,
                 options: SaverOptions, on_death: Callable[[str], None]) -> None:  # fmt: skip
        self.name = name
        self.live = live
        self.device = device
        self.footprint = footprint
        self.options = options
        self.state = SaverState()
        self._on_death = on_death
        self._gone = asyncio.Event()  # set when the server died or stops: its handlers stop waiting
        # The last control request sent to the scheduler: each runs after the one before.
        self._tail: asyncio.Future[None] | None = None
        live.step_crash = self._step_crash
        live.on_crash = self.die

    # --- the ledger ----------------------------------------------------------------------

    def occupy(self) -> None:
        """Take the memory a started server holds; refused when it does not fit (the shared
        device holds one resident server in the turns shape)."""
        f = self.footprint
        if not self.device.fits(f.resident_gib):
            raise MemoryError(
                f"the {self.name} server needs {f.resident_gib:.1f} GiB per GPU and the device has "
                f"{self.device.free_gib:.1f} GiB free: another server holds the memory (park it first)")
        self.device.hold(self.name, "fixed", f.fixed_gib)
        for tag in ALL_TAGS:
            self.device.hold(self.name, tag, f.region_gib(tag))

    def _backed_up(self, tag: str) -> bool:
        """Whether a tag's release keeps a host copy (load_model_utils.py:307-309)."""
        if tag == WEIGHTS:
            return self.options.weights_cpu_backup
        return tag == CUDA_GRAPH  # pausable graphs are backed up (full_cuda_graph_backend.py)

    def _has_regions(self, tag: str) -> bool:
        if not self.options.enable_memory_saver:
            return False  # the no-op adapter
        return tag != CUDA_GRAPH or self.options.cuda_graph_in_saver

    # --- the endpoints' operations --------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """``/pause_generation``: returns when SGLang answers."""
        self.state.tokenizer_paused = True
        self.live.holding_new = True
        if mode == "abort":
            busy = self.live.engine.has_work
            if busy and self.hung:
                await self._never()  # its requests never end, so the pause never ends
            # abort_all as the scheduler applies it: a queued request leaves at once
            # (scheduler.py:5693), a running one after one more forward pass (to_finish, :5802),
            # so a release sent before this pause answers can still find it running.
            for rid in self.live.engine.rids:
                self.live.disconnect(rid)
            if busy:
                await self._sleep(ABORT_PAUSE_POLL_S)
            return
        # Sent to the scheduler without waiting for it: applied after the step in flight.
        self._schedule(self._pause_scheduler(mode))

    async def _pause_scheduler(self, mode: str) -> None:
        self.live.engine.paused = True
        if mode == "retract":
            self.live.engine.retract()
            self.live.engine.stats.recent.clear()  # gen_throughput reads 0 (scheduler.py:5928)

    async def continue_generation(self) -> None:
        self.state.tokenizer_paused = False
        self._schedule(self._continue_scheduler())
        self.live.release_held()

    async def _continue_scheduler(self) -> None:
        self.live.engine.paused = False
        self.live.wake()

    async def release(self, tags: tuple[str, ...]) -> None:
        """``/release_memory_occupation``: returns when SGLang answers (or never)."""
        await self._until_gone(self._in_scheduler(self._release(tags)))

    async def resume(self, tags: tuple[str, ...]) -> None:
        await self._until_gone(self._in_scheduler(self._resume(tags)))

    async def _release(self, tags: tuple[str, ...]) -> None:
        engine = self.live.engine
        idle = engine.only_queued if engine.paused else engine.is_fully_idle
        if not idle:
            self.die("AssertionError: release_memory_occupation should be called only when server is idle.")
            await self._never()
        self.state.released.update(tags)
        for tag in (KV_CACHE, WEIGHTS, CUDA_GRAPH):
            if tag not in tags:
                continue
            if self._has_regions(tag):
                await self._pause_regions(tag)
            if tag == KV_CACHE:
                engine.flush_cache()

    async def _pause_regions(self, tag: str) -> None:
        if tag in self.state.paused_regions:
            self.die(f"torch_memory_saver: pause of the already paused tag {tag!r}")
            await self._never()
        gib = self.footprint.region_gib(tag)
        kept = tag in self.state.host_buffers
        await self._sleep(pause_cost_s(tag, gib, self.options, kept, self._backed_up(tag)))
        self.state.paused_regions.add(tag)
        self.device.free(self.name, tag)
        if tag == WEIGHTS:
            self.device.hold(self.name, "named buffers' clone", self.footprint.named_buffer_clone_gib)
        if self._backed_up(tag):
            self.state.host_buffers.add(tag)

    async def _resume(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            if tag not in self.state.released:
                self.die(f"KeyError: {tag!r}")  # offload_tags.remove (weight_updater.py:390)
                await self._never()
            self.state.released.discard(tag)
        for tag in (CUDA_GRAPH, WEIGHTS, KV_CACHE):
            if tag in tags and tag in self.state.paused_regions:
                await self._resume_regions(tag)

    async def _resume_regions(self, tag: str) -> None:
        gib = self.footprint.region_gib(tag)
        if not self.device.fits(gib):
            self._hang(f"cuMemCreate CUDA_ERROR_OUT_OF_MEMORY resuming {tag!r}: the other server "
                       "holds the memory")  # fmt: skip
            await self._never()
        self.device.hold(self.name, tag, gib)  # mapped first, then filled
        await self._sleep(resume_cost_s(tag, gib, self.options, self._backed_up(tag)))
        self.state.paused_regions.discard(tag)
        if not self.options.retain_cpu_backup:
            self.state.host_buffers.discard(tag)
        if tag == WEIGHTS:
            self.device.free(self.name, "named buffers' clone")
            self._weights_back()

    def _weights_back(self) -> None:
        """Weights paused without a host copy come back as whatever the pages hold."""
        if not self.options.weights_cpu_backup:
            self.state.weights_garbage = True
        draft_kept = self.options.weights_cpu_backup or self.options.draft_weights_cpu_backup
        if self.live.engine.profile.speculative and not draft_kept:
            self.live.engine.drafts_broken = True

    # --- how a server ends ----------------------------------------------------------------

    def _step_crash(self) -> str | None:
        missing = self.state.paused_regions & {WEIGHTS, KV_CACHE}
        if missing:
            return f"CUDA error: an illegal memory access (a step on released {', '.join(sorted(missing))})"
        return None

    def die(self, cause: str) -> None:
        """The scheduler raised: SIGQUIT, the whole server exits and the driver takes its
        memory back."""
        if self.state.status == "dead":
            return
        self.state.status, self.state.cause = "dead", cause
        self.live.halt()
        self.device.drop(self.name)
        self._gone.set()
        self._on_death(cause)

    def _hang(self, cause: str) -> None:
        self.state.status, self.state.cause = "hung", cause
        self.live.halt()

    @property
    def dead(self) -> bool:
        return self.state.status == "dead"

    @property
    def hung(self) -> bool:
        return self.state.status == "hung"

    def close(self) -> None:
        """The simulated server stops: whatever hangs in it ends (its answer is never sent)."""
        self._gone.set()

    async def wait_gone(self) -> None:
        await self._gone.wait()

    # --- plumbing -----------------------------------------------------------------------

    def _in_scheduler(self, work: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
        """A control request the scheduler handles between steps, after those sent before
        (its place in the line is taken now, when it is sent)."""
        before, self._tail = self._tail, asyncio.get_running_loop().create_future()
        return self._after(before, self._tail, work)

    async def _after(self, before: asyncio.Future[None] | None, done: asyncio.Future[None],
                     work: Coroutine[Any, Any, T]) -> T:  # fmt: skip
        try:
            if before is not None:
                await asyncio.shield(before)
            async with self.live.scheduler:
                if self.live.halted:
                    work.close()
                    await self._never()  # a hung scheduler takes nothing more
                return await work
        finally:
            if not done.done():
                done.set_result(None)

    async def after_control(self) -> None:
        """Returns once the control requests sent so far are done; never if one hangs (raises
        ServerDied when the server dies or stops meanwhile)."""
        if self._tail is not None and not self._tail.done():
            await self._until_gone(asyncio.shield(self._tail))
        if self.hung:
            await self._never()

    def _schedule(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(self._in_scheduler(work))
        task.add_done_callback(_retrieve)

    async def _until_gone(self, work: Awaitable[Any]) -> None:
        """``work``, or nothing more once the server is dead (its answer is never sent)."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self._gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            raise ServerDied(self.state.cause)
        task.result()

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds / self.live.speed)

    async def _never(self) -> None:
        """What a hung (or dead) server's handler does: wait, until the server is gone."""
        await self._gone.wait()
        raise ServerDied(self.state.cause or "stopped")


class ServerDied(Exception):
    """The simulated server exited while a handler waited for it."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
