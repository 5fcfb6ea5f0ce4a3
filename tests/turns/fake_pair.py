"""A small fake of two SGLang servers sharing one device with the memory saver, for the
driver's live tests until the simulator has it: the four endpoints with SGLang 0.5.23's
bodies and answers, and its hard failures (a release while requests run, or twice, kills the
server; a resume while the other holds never answers; a request reaching a released server
kills it). Faults make a call answer an error, hang, or kill the server."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.live import wait_until

CHUNK_S = 0.004  # one decode step of the fake
COPY_S = 0.2  # a finished request's pages, GPU to host (with HiCache)
STORE_S = 0.2  # ... then host to its store, while the scheduler runs


@dataclass
class Device:
    """The GPU the two share: who holds its memory, and what went wrong."""

    holders: set[str] = field(default_factory=set)
    most_holders: int = 0  # at any instant
    deaths: list[str] = field(default_factory=list)

    def take(self, name: str) -> None:
        self.holders.add(name)
        self.most_holders = max(self.most_holders, len(self.holders))


class FakeServer:
    def __init__(self, name: str, device: Device, *, holds: bool, accept_length: float | None,
                 hicache: bool = False):
        self.name = name
        self.hicache = hicache
        self.copies = 0  # device-to-host copies running
        self.host_backups = self.store_backups = self.lost_backups = 0  # tokens
        self.device = device
        self.holds = holds
        self.paused = not holds
        self.accept_length = accept_length
        self.faults: dict[str, str] = {}  # action -> error | hang | die
        self.calls: list[str] = []
        self.running = 0
        self.served = 0
        self.unpaused = asyncio.Event()
        if not self.paused:
            self.unpaused.set()
        self.control = asyncio.Lock()  # the scheduler: control calls and /server_info in order
        self.hang = asyncio.Event()  # set: a hung call goes on
        self.stop: asyncio.Event = asyncio.Event()  # set: the process exits
        if holds:
            device.take(name)

    def die(self, why: str) -> Response:
        self.device.deaths.append(f"{self.name}: {why}")
        self.device.holders.discard(self.name)
        self.stop.set()
        return Response(status_code=500)

    async def _fault(self, action: str) -> Response | None:
        fault = self.faults.pop(action, None)  # once: the next call goes through
        if fault == "error":
            return JSONResponse({"error": {"message": f"injected {action} error"}}, 400)
        if fault == "die":
            self.device.deaths.append(f"{self.name}: killed at {action} (injected)")
            self.device.holders.discard(self.name)
            self.stop.set()
            return Response(status_code=500)
        if fault == "hang":
            await self.hang.wait()
        return None

    async def pause(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(f"pause:{body.get('mode')}")
        async with self.control:
            if (answer := await self._fault("pause")) is not None:
                return answer
            self.paused = True
            self.unpaused.clear()
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def release(self, request: Request) -> Response:
        self.calls.append(f"release:{json.dumps(await request.json())}")
        async with self.control:
            if (answer := await self._fault("release")) is not None:
                return answer
            if not self.paused and self.running:
                return self.die("release while requests run")
            if self.copies:
                return self.die("release while a device-to-host copy of the KV runs")
            if not self.holds:
                return self.die("second release")
            self.holds = False
            self.device.holders.discard(self.name)
        return Response(b"null", media_type="application/json")

    async def resume(self, request: Request) -> Response:
        self.calls.append(f"resume:{json.dumps(await request.json())}")
        async with self.control:
            if (answer := await self._fault("resume")) is not None:
                return answer
            if self.holds:
                return self.die("second resume")
            if self.device.holders:
                await asyncio.Event().wait()  # out of memory: never answers
            self.holds = True
            self.device.take(self.name)
        return Response(b"null", media_type="application/json")

    async def continue_(self, request: Request) -> Response:
        self.calls.append("continue")
        async with self.control:
            if (answer := await self._fault("continue")) is not None:
                return answer
            self.paused = False
            self.unpaused.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if not self.paused else 503)

    async def ping(self, request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        async with self.control:
            return JSONResponse({"internal_states": [{"effective_max_running_requests_per_dp": 48}]})

    async def loads(self, request: Request) -> Response:
        return JSONResponse({"loads": [{"num_running_reqs": self.running, "num_waiting_reqs": 0}]})

    async def generate(self, request: Request) -> Response:
        await self.unpaused.wait()
        if (answer := await self._fault("generate")) is not None:
            return answer
        meta = {} if self.accept_length is None else {"spec_accept_length": self.accept_length}
        event = json.dumps({"text": "one", "meta_info": meta}).encode()
        return Response(b"data: " + event + b"\n\ndata: [DONE]\n\n", media_type="text/event-stream")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        tokens = int(body.get("max_tokens", 8))
        await self.unpaused.wait()  # SGLang's tokenizer holds new requests while paused
        if not self.holds:
            return self.die("a request reached a released server")
        return StreamingResponse(self._stream(tokens), media_type="text/event-stream")

    async def _stream(self, tokens: int) -> AsyncIterator[bytes]:
        self.running += 1
        try:
            for index in range(tokens):
                await self.unpaused.wait()  # retracted: silent until continue
                if not self.holds:
                    self.die("decoding without memory")
                    return
                await asyncio.sleep(CHUNK_S)
                chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"content": f"w{index} "}, "finish_reason": None}]}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            end = {"id": "c", "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3}}
            yield b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n"
            self.served += 1
            if self.hicache:
                asyncio.get_running_loop().create_task(self._back_up(tokens + 3))
        finally:
            self.running -= 1

    async def _back_up(self, tokens: int) -> None:
        self.copies += 1
        try:
            await asyncio.sleep(COPY_S)
        finally:
            self.copies -= 1
        self.host_backups += tokens
        await self.unpaused.wait()  # a paused scheduler issues no store write
        await asyncio.sleep(STORE_S)
        if self.holds:
            self.store_backups += tokens
        else:
            self.lost_backups += tokens  # the release dropped it

    async def metrics(self, request: Request) -> Response:
        if not self.hicache:
            return Response(status_code=404)
        return Response(
            f'sglang:hicache_backup_tokens_total{{tp_rank="0",pool="kv"}} {self.host_backups}.0\n'
            f'sglang:backuped_tokens_total{{tp_rank="0"}} {self.store_backups}.0\n'.encode(),
            media_type="text/plain")

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/pause_generation", self.pause, methods=["POST"]),
            Route("/release_memory_occupation", self.release, methods=["POST"]),
            Route("/resume_memory_occupation", self.resume, methods=["POST"]),
            Route("/continue_generation", self.continue_, methods=["POST"]),
            Route("/ready", self.ready), Route("/ping", self.ping),
            Route("/server_info", self.server_info), Route("/v1/loads", self.loads),
            Route("/metrics", self.metrics),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])


@contextlib.asynccontextmanager
async def serving(fake: FakeServer) -> AsyncIterator[str]:
    """Serve until the test ends or the fake dies (then its port refuses connections)."""
    config = uvicorn.Config(fake.app(), host="127.0.0.1", port=0, log_level="critical",
                            lifespan="off", access_log=False, timeout_graceful_shutdown=0)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=10)
    port = server.servers[0].sockets[0].getsockname()[1]

    async def exit_on_death() -> None:
        await fake.stop.wait()
        server.should_exit = True

    killer = asyncio.create_task(exit_on_death())
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        killer.cancel()
        server.should_exit = True
        await asyncio.wait_for(task, timeout=15)


@contextlib.asynccontextmanager
async def fake_pair(holder: str = "mtp", accept_length: float = 2.0, hicache: bool = False
                    ) -> AsyncIterator[tuple[Device, dict[str, FakeServer], dict[str, str]]]:
    device = Device()
    servers = {"mtp": FakeServer("mtp", device, holds=holder == "mtp", accept_length=accept_length,
                                 hicache=hicache),
               "plain": FakeServer("plain", device, holds=holder == "plain", accept_length=None,
                                   hicache=hicache)}
    async with serving(servers["mtp"]) as mtp, serving(servers["plain"]) as plain:
        yield device, servers, {"mtp": mtp, "plain": plain}
