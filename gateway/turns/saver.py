"""SGLang 0.5.23's memory-saver calls to one server, with the answers SGLang gives
(paths relative to sglang/srt; to move into the engine seam gateway/engine/sglang.py).

    POST /pause_generation {"mode": "retract"}      http_server.py:1831-1841: 200 with
                                                    {"message": ..., "status": "ok"}
    POST /release_memory_occupation {"tags": null}  http_server.py:1575-1584: 200 with body
    POST /resume_memory_occupation {"tags": null}   null (tags null: every region,
                                                    weight_updater.py:344-346); an error:
                                                    {"error": {"message": ...}}, 400
    POST /continue_generation {}                    http_server.py:1844-1854: 200
    GET /ready                                      http_server.py:714-718: 503 while paused
    GET /ping                                       http_server.py:2190-2199: 200 paused too
    GET /server_info                                answered by the scheduler, after any
                                                    control call sent before it
    POST /generate                                  meta_info.spec_accept_length
                                                    (tokenizer_manager.py:3149)

All four memory-saver endpoints are ADMIN_OPTIONAL (utils/auth.py:133-147): the admin key
when the server has one, else its api key, else none.
"""

from __future__ import annotations

import json

from gateway.config import Backend
from gateway.errors import GatewayError, UpstreamConnectError, UpstreamTimeout
from gateway.monitor import parse_loads
from gateway.turns.state import FailureKind, Probe
from gateway.upstream import Upstream

ALL_TAGS = b'{"tags":null}'
# A short greedy generation to read the accept length after a resume into MTP: with drafts
# that came back wrong (sglang #31674) it is ~1.0, with good ones near its usual value.
SPECULATION_PROBE = json.dumps({
    "text": "Count from one to twenty: one, two, three,",
    "sampling_params": {"max_new_tokens": 32, "temperature": 0.0}}).encode()


class CallFailed(Exception):
    """A control call that did not succeed: how (`kind`), and whether it may have reached
    the server (`sent`: False only when the connection was refused)."""

    def __init__(self, kind: FailureKind, detail: str, *, sent: bool = True) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.sent = sent


class MemorySaver:
    """The control calls to one SGLang server of a turns pair."""

    def __init__(self, upstream: Upstream, target: Backend, name: str) -> None:
        self.upstream = upstream
        self.target = target
        self.name = name
        admin = target.admin_api_key or target.api_key
        self._admin = [(b"authorization", f"Bearer {admin}".encode())] if admin else []
        self._user = ([(b"authorization", f"Bearer {target.api_key}".encode())]
                      if target.api_key else [])

    async def pause(self, timeout_s: float) -> None:
        await self._post("/pause_generation", b'{"mode":"retract"}', timeout_s)

    async def release(self, timeout_s: float) -> None:
        await self._post("/release_memory_occupation", ALL_TAGS, timeout_s, expect=b"null")

    async def resume(self, timeout_s: float) -> None:
        await self._post("/resume_memory_occupation", ALL_TAGS, timeout_s, expect=b"null")

    async def continue_generation(self, timeout_s: float) -> None:
        await self._post("/continue_generation", b"{}", timeout_s)

    async def ready(self, timeout_s: float) -> bool:
        return await self._status("/ready", timeout_s) == 200

    async def probe(self, timeout_s: float) -> Probe:
        if await self._status("/ping", timeout_s) != 200:
            return Probe(alive=False)
        ready = await self._status("/ready", timeout_s) == 200
        answers = await self._status("/server_info", timeout_s) == 200
        return Probe(alive=True, ready=ready, scheduler_answers=answers)

    async def busy(self, timeout_s: float) -> int | None:
        """Requests running or waiting there, every client's (/v1/loads); None: it cannot say."""
        try:
            status, body = await self._call("GET", "/v1/loads", None, timeout_s, self._user)
            loads = parse_loads(json.loads(body)) if status == 200 else None
        except (CallFailed, ValueError, TypeError):
            return None
        return None if loads is None else sum(loads)

    async def accept_length(self, timeout_s: float) -> float | None:
        """The accept length of one short greedy generation (None: not a speculative server,
        or no figure in its answer)."""
        status, body = await self._call("POST", "/generate", SPECULATION_PROBE, timeout_s,
                                        self._user)
        if status != 200:
            raise CallFailed("error", f"{self.name} /generate answered {status}")
        try:
            meta = json.loads(body).get("meta_info") or {}
        except (ValueError, AttributeError):
            raise CallFailed("error", f"{self.name} /generate: not SGLang's answer") from None
        value = meta.get("spec_accept_length")
        return float(value) if isinstance(value, int | float) else None

    async def _post(self, path: str, body: bytes, timeout_s: float, *,
                    expect: bytes | None = None) -> None:
        status, answer = await self._call("POST", path, body, timeout_s, self._admin)
        if status != 200:
            raise CallFailed("error", f"{self.name} {path} answered {status}: "
                             f"{_message(answer)}")
        if expect is not None and answer.strip() != expect:
            raise CallFailed("error", f"{self.name} {path} answered 200 with "
                             f"{answer[:200].decode('utf-8', 'replace')!r}, not {expect!r}")

    async def _status(self, path: str, timeout_s: float) -> int | None:
        """A probe's status; None when the server does not answer."""
        try:
            status, _ = await self._call("GET", path, None, timeout_s, self._user)
        except CallFailed:
            return None
        return status

    async def _call(self, method: str, path: str, body: bytes | None, timeout_s: float,
                    auth: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
        headers = [(b"content-type", b"application/json"), *auth] if body is not None else auth
        try:
            return await self.upstream.request(method, self.target.url + path, headers, body,
                                               timeout_s)
        except UpstreamTimeout as exc:
            refused = exc.kind == "timeout_connect"
            raise CallFailed("timeout" if not refused else "gone", f"{self.name} {path}: "
                             f"{exc.message}", sent=not refused) from None
        except UpstreamConnectError as exc:
            # Refused at connect: nothing was sent. Closed before answering: it may have been.
            refused = exc.message.startswith("cannot connect")
            raise CallFailed("gone", f"{self.name} {path}: {exc.message}",
                             sent=not refused) from None
        except GatewayError as exc:  # broken mid-answer
            raise CallFailed("gone", f"{self.name} {path}: {exc.message}") from None


def _message(answer: bytes) -> str:
    try:
        error = json.loads(answer).get("error") or {}
        return str(error.get("message", ""))[:300]
    except (ValueError, AttributeError):
        return answer[:300].decode("utf-8", "replace")

