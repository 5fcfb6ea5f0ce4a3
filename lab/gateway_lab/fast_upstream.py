"""A fast fake OpenAI upstream for the overhead benchmark: raw asyncio + uvloop, no framework.

It must never be the bottleneck: one Protocol per connection, one timer per stream, every
byte pre-built. Streams are shaped like SGLang 0.5.23's `/v1/chat/completions` (see
gateway/sim/formats.py): a role chunk, exactly `max_tokens` content chunks, a finish chunk and
`data: [DONE]`, each its own write inside HTTP/1.1 chunked framing, the way uvicorn sends them.
The first content chunk comes `ttft_ms` after the request, then one every `itl_ms`. A request
may override both with the body fields `bench_ttft_ms` / `bench_itl_ms` (the gateway forwards
the body untouched), which the 1,000-open-streams measurement uses.

The monitor's endpoints answer too: `GET /v1/loads`, `/server_info` (effective running cap
1000, so the capacity guard never interferes), `/v1/models`, `/health`, `POST /abort_request`.
`GET /_stats` reports connections and requests seen (did the gateway reuse its connections?).

    python -m gateway_lab.fast_upstream --port 0 [--ttft-ms 20] [--itl-ms 10]

prints `READY <port>` on stdout once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import sys
import time
from typing import Any

MODEL = "bench-model"
EFFECTIVE_CAP = 1000
# Eight distinct words: some proxies reject a stream that repeats one chunk verbatim.
TOKENS = [b" alpha", b" bravo", b" charlie", b" delta", b" echo", b" foxtrot", b" golf", b" hotel"]

_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
             b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
_DONE_FRAME = b"e\r\ndata: [DONE]\n\n\r\n"
_LAST_FRAME = b"0\r\n\r\n"
_CONTENT = b'{"reasoning_content":null,"content":"'
_TAIL = b',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'


def raise_nofile_limit() -> None:
    """Thousands of sockets: lift the soft open-files limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass


def frame(payload: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _json_response(obj: Any, status: str = "200 OK") -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class Stats:
    def __init__(self) -> None:
        self.connections = 0
        self.open_connections = 0
        self.requests = 0
        self.streams_open = 0
        self.max_streams_open = 0
        self.aborts = 0
        self.started = time.time()

    def as_dict(self) -> dict[str, Any]:
        return {"connections": self.connections, "open_connections": self.open_connections,
                "requests": self.requests, "streams_open": self.streams_open,
                "max_streams_open": self.max_streams_open, "aborts": self.aborts}


class _Stream:
    """One streamed completion: a chain of timer callbacks writing pre-built frames."""

    __slots__ = ("conn", "head", "n", "sent", "start", "ttft", "itl", "handle", "usage")

    def __init__(self, conn: UpstreamConnection, rid: str, n: int, ttft: float, itl: float,
                 usage: bool) -> None:
        self.conn = conn
        created = int(time.time())
        self.head = (b'data: {"id":"' + rid.encode() + b'","object":"chat.completion.chunk","created":'
                     + str(created).encode() + b',"model":"' + MODEL.encode()
                     + b'","choices":[{"index":0,"delta":')
        self.n = n
        self.sent = 0
        self.ttft = ttft
        self.itl = itl
        self.usage = usage
        self.start = conn.loop.time()
        self.handle: asyncio.TimerHandle | None = conn.loop.call_at(self.start + ttft, self.first)

    def first(self) -> None:
        role = self.head + b'{"reasoning_content":null,"role":"assistant","content":""}' + _TAIL
        self.conn.transport.write(frame(role))
        self.next()

    def next(self) -> None:
        conn = self.conn
        write = conn.transport.write
        if self.sent < self.n:
            token = TOKENS[self.sent % len(TOKENS)]
            self.sent += 1
            write(frame(self.head + _CONTENT + token + b'"}' + _TAIL))
            if self.sent < self.n:
                when = self.start + self.ttft + self.sent * self.itl
                self.handle = conn.loop.call_at(when, self.next)
                return
        finish = (self.head + b'{"reasoning_content":null},"logprobs":null,"finish_reason":"length",'
                  b'"matched_stop":null}]}\n\n')
        write(frame(finish))
        if self.usage:
            usage = (b'{"prompt_tokens":12,"total_tokens":' + str(12 + self.n).encode()
                     + b',"completion_tokens":' + str(self.n).encode() + b'}')
            head = self.head[: self.head.index(b'"choices":')]
            write(frame(head + b'"choices":[],"usage":' + usage + b"}\n\n"))
        write(_DONE_FRAME)
        write(_LAST_FRAME)
        self.handle = None
        conn.finished_stream()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class UpstreamConnection(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, one request at a time (clients do not pipeline here)."""

    def __init__(self, server: FakeUpstream) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.buf = bytearray()
        self.need = -1  # total bytes of the request being received, once its head is parsed
        self.head: tuple[str, str, bool] | None = None
        self.busy: _Stream | asyncio.TimerHandle | None = None
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        stats = self.server.stats
        stats.connections += 1
        stats.open_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.stats.open_connections -= 1
        busy, self.busy = self.busy, None
        if isinstance(busy, _Stream):
            busy.cancel()
            self.server.stats.streams_open -= 1
        elif busy is not None:
            busy.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._process()

    def _process(self) -> None:
        while self.busy is None and not self.transport.is_closing():
            buf = self.buf
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
                request_line = lines[0].split(" ", 2)
                if len(request_line) != 3 or request_line[0] == "PRI":
                    # Not HTTP/1.1: sglang-router probes with HTTP/2's preface first; refuse it
                    # the way uvicorn does, and it carries on in HTTP/1.1.
                    self.transport.write(_json_response({"error": "HTTP/1.1 only"}, "400 Bad Request"))
                    self.transport.close()
                    return
                method, path, _ = request_line
                length, close = 0, False
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    name = name.strip().lower()
                    if name == "content-length":
                        length = int(value)
                    elif name == "connection":
                        close = value.strip().lower() == "close"
                    elif name == "transfer-encoding":
                        self.transport.write(_json_response({"error": "chunked bodies unsupported"},
                                                            "411 Length Required"))
                        self.transport.close()
                        return
                del buf[: end + 4]
                self.need, self.head = length, (method, path, close)
            if len(buf) < self.need:
                return
            body = bytes(buf[: self.need])
            del buf[: self.need]
            method, path, close = self.head  # type: ignore[misc]
            self.need, self.head = -1, None
            self.close_after = close
            self.server.stats.requests += 1
            self._handle(method, path.split("?", 1)[0], body)
            if self.busy is None:
                self._done()

    def _done(self) -> None:
        if self.close_after:
            self.transport.close()

    def finished_stream(self) -> None:
        self.busy = None
        self.server.stats.streams_open -= 1
        self._done()
        if self.buf:
            self._process()

    def _handle(self, method: str, path: str, body: bytes) -> None:
        write = self.transport.write
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            self._completion(body)
        elif method == "GET" and path == "/v1/loads":
            load = {"dp_rank": 0, "num_running_reqs": self.server.stats.streams_open,
                    "num_waiting_reqs": 0, "max_running_requests": EFFECTIVE_CAP}
            write(_json_response({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00"),
                                  "version": "fast-upstream", "loads": [load]}))
        elif method == "GET" and path in ("/server_info", "/get_server_info"):
            write(_json_response({
                "model_path": MODEL, "served_model_name": MODEL, "max_running_requests": EFFECTIVE_CAP,
                "internal_states": [{"effective_max_running_requests_per_dp": EFFECTIVE_CAP}],
                "version": "fast-upstream",
            }))
        elif method == "GET" and path == "/v1/models":
            write(_json_response({"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "fast-upstream"}]}))
        elif method == "GET" and path == "/health":
            write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif method == "GET" and path == "/_stats":
            write(_json_response(self.server.stats.as_dict()))
        elif method == "POST" and path == "/abort_request":
            self.server.stats.aborts += 1
            write(_json_response({}))
        else:
            write(_json_response({"error": {"message": f"no route {method} {path}"}}, "404 Not Found"))

    def _completion(self, body: bytes) -> None:
        server = self.server
        try:
            data = json.loads(body)
            # sglang-router forwards the OpenAI name, max_completion_tokens
            n = int(data.get("max_tokens") or data.get("max_completion_tokens") or 16)
            ttft = float(data.get("bench_ttft_ms", server.ttft_ms)) / 1000
            itl = float(data.get("bench_itl_ms", server.itl_ms)) / 1000
            rid = str(data.get("rid") or f"chatcmpl-{next(server.ids):032x}")
        except (ValueError, TypeError, AttributeError) as exc:
            self.transport.write(_json_response({"error": {"message": f"bad request: {exc}"}},
                                                "400 Bad Request"))
            return
        if n < 1:
            n = 1
        if data.get("stream"):
            self.transport.write(_SSE_HEAD)
            usage = bool((data.get("stream_options") or {}).get("include_usage"))
            self.busy = _Stream(self, rid, n, ttft, itl, usage)
            stats = server.stats
            stats.streams_open += 1
            stats.max_streams_open = max(stats.max_streams_open, stats.streams_open)
            return
        text = "".join(TOKENS[i % len(TOKENS)].decode() for i in range(n))
        answer = _json_response({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text,
                                                 "reasoning_content": None, "tool_calls": None},
                         "logprobs": None, "finish_reason": "length", "matched_stop": None}],
            "usage": {"prompt_tokens": 12, "total_tokens": 12 + n, "completion_tokens": n},
        })
        self.busy = self.loop.call_later(ttft + (n - 1) * itl, self._answer, answer)

    def _answer(self, answer: bytes) -> None:
        self.busy = None
        if not self.transport.is_closing():
            self.transport.write(answer)
            self._done()
            if self.buf:
                self._process()


class FakeUpstream:
    def __init__(self, ttft_ms: float = 20.0, itl_ms: float = 10.0) -> None:
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.stats = Stats()
        self.ids = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(lambda: UpstreamConnection(self), host, port,
                                                    backlog=4096, reuse_address=True)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def _serve(args: argparse.Namespace) -> None:
    upstream = FakeUpstream(args.ttft_ms, args.itl_ms)
    port = await upstream.start(args.host, args.port)
    print(f"READY {port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fast_upstream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    args = parser.parse_args(argv)
    raise_nofile_limit()
    try:
        import uvloop

        uvloop.run(_serve(args))
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
