"""Both simulated servers (mtp and plain) in the current event loop, on real sockets.

    async with start_sim_pair(SimOptions(speed=20)) as pair:
        pair.urls["mtp"], pair.urls["plain"]        # http://127.0.0.1:<port>
        pair.servers["mtp"].live.engine             # engine state (num_running, stats, ...)
        await pair.servers["plain"].set_faults(Faults(refuse_connections=True))

Used by the tests, ``mtp-gateway demo`` and ``mtp-gateway sim``. Ports 0 mean OS-assigned.

``SimOptions(memory="turns")`` starts the pair in SGLang's turns shape: both with the memory
saver (``--enable-memory-saver``, weights' host copy, pausable graphs, retained host copies),
each sized for the whole GPU; plain starts first and is parked (paused in abort mode, all its
memory released), then MTP starts on what plain left and holds the GPU. The shared device keeps
the ledger of who holds what; a server the memory saver kills stops answering as a crashed
process does (``pair.servers[name].saver.dead``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import socket
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.sim import memory as sizing
from gateway.sim.app import ServerIdentity, SimApp
from gateway.sim.context import ServerContext
from gateway.sim.engine import Engine
from gateway.sim.faults import Faults, FaultState
from gateway.sim.live import Device, LiveEngine
from gateway.sim.profile import Profile, load_profiles, packaged_timings
from gateway.sim.responses_store import ResponsesStore
from gateway.sim.saver import (
    ALL_TAGS,
    HOST_LINK_GBPS,
    TURNS_FIRST,
    Footprint,
    MemorySaver,
    SaverOptions,
    footprint_of,
    turns_sizings,
)
from gateway.sim.vllm.app import VllmApp, VllmOptions, check_max_num_seqs
from gateway.sim.vllm.sleep import SleepMode

ENGINES = ("sglang", "vllm")

BACKENDS = ("mtp", "plain")


@dataclass(frozen=True)
class SimOptions:
    """How to run the pair. ``profiles``: loaded profiles, a YAML path, or None for defaults.
    ``speed``: simulated seconds per real second (20 = 20x faster than the modelled GPU)."""

    host: str = "127.0.0.1"
    mtp_port: int = 0
    plain_port: int = 0
    profiles: Mapping[str, Profile] | str | Path | None = None
    speed: float = 1.0
    seed: int = 0
    shared_device: bool = True
    api_key: str | None = None
    admin_api_key: str | None = None  # --admin-api-key: guards /abort_request instead of api_key
    max_queued_requests: int | None = None  # --max-queued-requests, for both (None: the profiles')
    enable_response_store: bool = False  # --enable-response-store (SGLang's default: off)
    # SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1: x-override-rid sets the rid of chat, messages, /generate
    request_header_overrides: bool = False
    faults: Mapping[str, Faults] = field(default_factory=dict)  # initial faults per backend
    log_level: str = "warning"
    # "split": both resident, the memory shared (today's pair); "turns": one resident at a time.
    memory: str = "split"
    hardware: str = sizing.DEFAULT_HARDWARE  # sizes, device capacity and host link
    # The memory saver's flags and environment (None: the shape's own, off for split, all on
    # for turns as docker's turns deployment starts them).
    saver: SaverOptions | None = None
    # Which engine the servers speak: SGLang 0.5.23, or vLLM 0.33.0 (gateway/sim/vllm/).
    engine: str = "sglang"
    vllm: VllmOptions = VllmOptions()

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.memory not in ("split", "turns"):
            raise ValueError(f"memory must be 'split' or 'turns', not {self.memory!r}")
        if self.hardware not in sizing.HARDWARE:
            raise ValueError(f"unknown hardware {self.hardware!r} ({', '.join(sizing.HARDWARE)})")

    def resolved_saver(self) -> SaverOptions:
        if self.saver is not None:
            return self.saver
        link = HOST_LINK_GBPS[self.hardware]
        if self.engine == "vllm":
            # --enable-sleep-mode: level 1 copies the weights to a host buffer allocated at each
            # sleep and dropped at each wake (cumem.py:255-298, :355-360); the CUDA graphs stay.
            return SaverOptions(enable_memory_saver=bool(self.resolved_vllm().enable_sleep_mode),
                                weights_cpu_backup=True, host_link_gbps=link)
        if self.memory == "split":
            return SaverOptions(host_link_gbps=link)
        return SaverOptions(enable_memory_saver=True, weights_cpu_backup=True, cuda_graph_in_saver=True,
                            retain_cpu_backup=True, host_link_gbps=link)  # fmt: skip

    def resolved_vllm(self) -> VllmOptions:
        """The vLLM servers' options, sleep mode the shape's where not said."""
        if self.vllm.enable_sleep_mode is not None:
            return self.vllm
        return dataclasses.replace(self.vllm, enable_sleep_mode=self.memory == "turns")

    def sizings(self) -> dict[str, sizing.Sizing]:
        hardware = sizing.HARDWARE[self.hardware]
        if self.memory == "turns":
            return turns_sizings(hardware, self.resolved_saver())
        return sizing.size_pair(hardware)

    def resolved_profiles(self) -> dict[str, Profile]:
        if self.profiles is None and self.memory == "turns":
            timings, sizes = packaged_timings(), self.sizings()
            profiles = {name: sizing.with_sizing(timings[name], sizes[name]) for name in BACKENDS}
        elif self.profiles is None or isinstance(self.profiles, str | Path):
            profiles = load_profiles(self.profiles, self.hardware)
        else:
            profiles = dict(self.profiles)
        if self.max_queued_requests is not None:
            limit = self.max_queued_requests
            profiles = {n: dataclasses.replace(p, max_queued_requests=limit) for n, p in profiles.items()}
        if self.engine == "vllm" and self.vllm.max_num_seqs is not None:
            seqs = self.vllm.max_num_seqs
            profiles = {n: dataclasses.replace(p, max_running_requests=seqs) for n, p in profiles.items()}
        if self.engine == "vllm" and (self.vllm.draft_schedule or self.vllm.num_speculative_tokens):
            # k draft tokens a step (the schedule's at each batch size, else num_speculative_tokens
            # every step): the MTP one-step table with plain's step as its base
            # (Profile.spec_step_s), as the SGLang simulator's adaptive server has it.
            mtp = profiles["mtp"]
            k = self.vllm.num_speculative_tokens or mtp.num_steps
            profiles["mtp"] = dataclasses.replace(mtp, num_steps=k, base_step_ms=profiles["plain"].step_ms,
                                                  draft_schedule=self.vllm.draft_schedule or ((1, 1, k),))
        return profiles


class _Server(uvicorn.Server):
    """uvicorn without signal handling: two of them share a loop owned by someone else."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _HttpProtocolClass(Protocol):
    """How uvicorn builds its HTTP protocols (``Server.startup``'s create_protocol): every one
    takes these, though ``Config.http_protocol_class`` is typed only ``type[asyncio.Protocol]``."""

    def __call__(self, *, config: uvicorn.Config, server_state: ServerState,
                 app_state: dict[str, Any]) -> asyncio.Protocol: ...


class SimServer:
    """One simulated SGLang server: engine driver, HTTP app, listening socket, faults."""

    def __init__(self, name: str, profile: Profile, device: Device, options: SimOptions,
                 footprint: Footprint | None = None) -> None:  # fmt: skip
        self.name = name
        self.faults = FaultState(on_refuse=self._on_refuse)
        engine = Engine(profile, random.Random(f"{options.seed}:{name}"))
        self.live = LiveEngine(engine, device, options.speed, self.faults)
        if footprint is None:
            hardware = sizing.HARDWARE[options.hardware]
            footprint = footprint_of(name, options.sizings()[name], hardware)
        self.saver = MemorySaver(name, self.live, device, footprint, options.resolved_saver(), self._die)
        self.sleep_mode: SleepMode | None = None
        self._down = False  # crashed or refusing: no connection is served (_go_down)
        port = options.mtp_port if name == "mtp" else options.plain_port
        self._host = options.host
        self._sock = _bind(options.host, port)
        self.port = self._sock.getsockname()[1]
        identity = ServerIdentity(name, options.host, self.port, options.seed)
        if options.engine == "vllm":
            asgi = self._vllm_app(identity, profile, device, options)
        else:
            self.app = SimApp(identity, self.live, self.faults, self.saver, options.enable_response_store,
                              options.request_header_overrides)
            asgi = self.app.build(options.api_key, options.admin_api_key)
        config = uvicorn.Config(
            asgi, lifespan="off",
            http=_closed_while_down(lambda: self._down), log_level=options.log_level,
            access_log=False, timeout_graceful_shutdown=1,
        )  # fmt: skip
        self._uvicorn = _Server(config)
        self._task: asyncio.Task[None] | None = None

    def _vllm_app(self, identity: ServerIdentity, profile: Profile, device: Device,
                  options: SimOptions) -> Any:  # fmt: skip
        """A vLLM 0.33.0 server on the same engine core, device and faults."""
        check_max_num_seqs(options.vllm.max_num_seqs, profile.mamba_slots)
        context = ServerContext(identity, self.live, self.faults, ResponsesStore(False), self.saver)
        self.sleep_mode = SleepMode(self.name, self.live, device, self.saver.footprint, self.saver.options)
        self.vllm_app = VllmApp(context, self.sleep_mode, options.resolved_vllm())
        return self.vllm_app.build(options.api_key)

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        self.saver.occupy()
        self.live.start()
        self._task = asyncio.create_task(self._uvicorn.serve(sockets=[self._sock]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self.faults.close()
        self.saver.close()
        await self.live.stop()
        self._uvicorn.should_exit = True
        if self._task is None:
            self._sock.close()  # never served: uvicorn did not take the socket over
        else:
            await self._task

    async def set_faults(self, faults: Faults) -> None:
        await self.faults.set(faults)

    async def clear_faults(self) -> None:
        await self.faults.clear()

    async def park(self) -> None:
        """Pause (abort) and release all memory: how a turns pair parks its first server (a vLLM
        server sleeps at level 1)."""
        if self.sleep_mode is not None:
            await self.sleep_mode.sleep(1, "abort")
            return
        await self.saver.pause("abort")
        await self.saver.release(ALL_TAGS)

    def _die(self, cause: str) -> None:
        """The process exited (the memory saver killed it): as the crash fault, for good."""
        self._go_down()

    async def _on_refuse(self, refuse: bool) -> None:
        """Go down like a crashed backend (stop listening, drop every connection, lose every
        request), or come back on the same port like a restarted one."""
        if refuse:
            self._go_down()
            return
        if self.saver.dead:
            return  # a dead process does not come back
        self._down = False
        config = self._uvicorn.config
        protocol = functools.partial(
            cast(_HttpProtocolClass, config.http_protocol_class), config=config,
            server_state=self._uvicorn.server_state, app_state=self._uvicorn.lifespan.state,
        )  # fmt: skip
        listener = await asyncio.get_running_loop().create_server(
            protocol, sock=_bind(self._host, self.port)
        )
        self._uvicorn.servers.append(listener)


    def _go_down(self) -> None:
        self._down = True  # and the connections accepted but not yet made (_closed_while_down)
        for listener in self._uvicorn.servers:
            listener.close()
        for connection in list(self._uvicorn.server_state.connections):
            connection.transport.close()
        self.live.abort(abort_all=True)


def _closed_while_down(down: Callable[[], bool]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools, as "auto" picks it: a dependency of the gateway),
    closing a connection made while its server is down. asyncio tells a protocol of its
    connection (connection_made) a loop iteration after making its transport, so a connection
    accepted just before the server went down was in no list `_go_down` sweeps: it was served
    after the death, its request waiting forever on the halted engine (a dead process serves
    nothing)."""

    class SimHttpProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if down():
                transport.close()

    return SimHttpProtocol


def _bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and without
    # it every response after the first on a kept-alive connection waits for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


@dataclass
class SimPair:
    servers: dict[str, SimServer]

    @property
    def urls(self) -> dict[str, str]:
        return {name: server.url for name, server in self.servers.items()}


@contextlib.asynccontextmanager
async def start_sim_pair(options: SimOptions | None = None) -> AsyncIterator[SimPair]:
    """Start both servers in the running loop; stop them (aborting what runs) on exit."""
    options = options or SimOptions()
    profiles = options.resolved_profiles()
    capacity = sizing.HARDWARE[options.hardware].gpu_gib if options.memory == "turns" else None
    shared = Device(capacity)
    servers: dict[str, SimServer] = {}
    try:
        for name in BACKENDS:
            device = shared if options.shared_device else Device(capacity)
            servers[name] = SimServer(name, profiles[name], device, options)
        order = [TURNS_FIRST, *(n for n in BACKENDS if n != TURNS_FIRST)] if capacity else list(BACKENDS)
        for name in order:
            server = servers[name]
            await server.start()
            await server.set_faults(options.faults.get(name, Faults()))
            if capacity is not None and name == TURNS_FIRST:
                await server.park()  # the next server measures its memory beside the parked one
        yield SimPair(servers)
    finally:
        await asyncio.gather(*(server.stop() for server in servers.values()))
