"""SGLang 0.5.23, as the gateway uses it (paths relative to sglang/srt/). See
gateway/upstream/engine/__init__.py for what this module provides and why it is one place."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import secrets
from typing import Any

from gateway.apis.errors import GatewayError, UpstreamConnectError, UpstreamTimeout
from gateway.config import Backend
from gateway.upstream.client import Header, Upstream
from gateway.upstream.engine.probe import CallFailed, Probe, SaverReport

log = logging.getLogger("mtp_gateway.relay")

# --- request ids ----------------------------------------------------------------------------

# Where SGLang takes a request id from the body, and under which name. /v1/responses uses
# its `request_id` as the rid and as the response's id (serving_responses.py:592, protocol.py:1973).
RID_FIELDS = {"/v1/chat/completions": "rid", "/v1/completions": "rid", "/generate": "rid",
              "/v1/responses": "request_id"}
RESPONSE_ID_PREFIX = "resp_"  # a response id must start so to be named as previous_response_id
# /v1/messages has no rid field (anthropic/protocol.py:370); SGLang reads this header instead
# when launched with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1 (request_headers.py:11,
# serving_chat.py:1417), and ignores it otherwise.
RID_HEADER = b"x-override-rid"
RID_HEADER_PATHS = frozenset({"/v1/messages"})

# Request ids: random per process (no clash between gateway replicas), then a counter, so
# no system call per request; 32 hex characters like SGLang's own.
_RID_PREFIX = f"{secrets.randbits(64):016x}"
_rids = (f"{_RID_PREFIX}{n:016x}" for n in itertools.count())


def new_rid() -> str:
    return next(_rids)


def abort_rids(rid: str | None, samples: int, batch: int | None) -> tuple[str, ...]:
    """The rids SGLang gives the work of one request (`batch`: the length of a list of
    prompts, None for one), as far as they can be known.

    A batch runs as `rid_0`, `rid_1`, ... (io_struct.py:764), and SGLang's /abort_request needs
    the exact rid (tokenizer_manager.py:2246). With n > 1 every sample gets a fresh random rid
    (tokenizer_manager.py:2174, `regenerate_rid`): nothing the gateway sends can name them, so
    no abort is sent."""
    if rid is None or samples > 1:
        return ()
    return (rid,) if batch is None else tuple(f"{rid}_{i}" for i in range(batch))


# --- aborts ---------------------------------------------------------------------------------

ABORT = "/abort_request"  # http_server.py:1721, auth level ADMIN_OPTIONAL


def admin_headers(target: Backend) -> list[Header]:
    """An ADMIN_OPTIONAL endpoint takes the admin key when the server has one, else its API
    key, else none (utils/auth.py:133-143)."""
    key = target.admin_api_key or target.api_key
    return [(b"authorization", f"Bearer {key}".encode())] if key else []


async def abort(upstream: Upstream, target: Backend, name: str, rid: str) -> None:
    """Stop the work of `rid` on the backend `name` now (SGLang's own check comes 2 s after
    the socket closes). A failure is logged, never raised: the request has ended anyway."""
    try:
        status = await upstream.post_json(target.url + ABORT, json.dumps({"rid": rid}).encode(),
                                          admin_headers(target), 5.0)
    except GatewayError as exc:
        log.info("abort of %s on %s failed: %s", rid, name, exc.message)
        return
    if status in (401, 403):
        log.warning("abort of %s on %s refused with HTTP %d: set backends.%s.admin_api_key "
                    "to the server's --admin-api-key", rid, name, status, name)


# --- what the monitor reads -----------------------------------------------------------------

LOADS = "/v1/loads"  # entrypoints/v1_loads.py:96: a snapshot, cheap
SERVER_INFO = "/server_info"  # http_server.py:863: the running cap and the accept length
MODELS = "/v1/models"  # the probe of a server without LOADS (not SGLang, or its router)
# /health and /health_generate run a one-token generation when the server is idle (with
# SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION; http_server.py:721-760): over a second, so no probe
# under load. /ready: 200 once the tokenizer manager is ready (http_server.py:714-718).
HEALTH, HEALTH_GENERATE, READY = "/health", "/health_generate", "/ready"
NOT_PROVIDED = (404, 405)  # the server answers, but has no such endpoint


def probe_headers(target: Backend) -> list[Header]:
    return [(b"authorization", f"Bearer {target.api_key}".encode())] if target.api_key else []


def parse_server_info(info: Any) -> tuple[int | None, float | None]:
    """(effective running cap, accept length) from SGLang's /server_info."""
    if not isinstance(info, dict):
        return None, None
    states = info.get("internal_states") or [{}]
    state = states[0] if isinstance(states, list) and states and isinstance(states[0], dict) else {}
    cap = state.get("effective_max_running_requests_per_dp", info.get("max_running_requests"))
    accept = state.get("avg_spec_accept_length")
    return (int(cap) if isinstance(cap, int | float) else None,
            float(accept) if isinstance(accept, int | float) else None)


# --enable-memory-saver (arg_groups/fields/exec_.py:58-61, default False): /server_info carries
# every resolved server argument (http_server.py:863-893, utils/common.py:3589 resolved_dict).
MEMORY_SAVER_FIELD = "enable_memory_saver"


def memory_saver_flag(body: bytes) -> bool | None:
    """The server's --enable-memory-saver from its /server_info body (None: it does not say)."""
    try:
        flag = json.loads(body).get(MEMORY_SAVER_FIELD)
    except (ValueError, AttributeError):
        return None
    return flag if isinstance(flag, bool) else None


def memory_saver_report(status: int | None, body: bytes) -> SaverReport:
    """What a /server_info answer says of the memory saver (status None: no answer). A server
    without the endpoint (404/405: not SGLang, or its router) answers without saying."""
    if status is None or (status != 200 and status not in NOT_PROVIDED):
        return "silent"  # not up yet, or its scheduler busy: asked again
    flag = memory_saver_flag(body) if status == 200 else None
    return "unsaid" if flag is None else "on" if flag else "off"


async def read_memory_saver(upstream: Upstream, target: Backend, timeout_s: float) -> SaverReport:
    """Ask one server's /server_info whether it runs with the memory saver."""
    return memory_saver_report(*await answer_of(upstream, target, SERVER_INFO, timeout_s))


async def answer_of(upstream: Upstream, target: Backend, path: str,
                    timeout_s: float) -> tuple[int | None, bytes]:
    """One GET's status and body (status None: no answer), any engine's."""
    try:
        return await upstream.request("GET", target.url + path, probe_headers(target), None, timeout_s)
    except GatewayError:
        return None, b""


def usage_by_default(info: Any) -> bool:
    """Whether the server sends a stream's usage chunk unasked (--stream-response-default-include-usage,
    arg_groups/fields/serving.py:270; /server_info carries every server arg, utils/common.py:3589)."""
    return isinstance(info, dict) and info.get("stream_response_default_include_usage") is True


# The usage chunk of a chat or completions stream: choices empty, usage set (serving_chat.py:2790-2797,
# serving_completions.py:479-; compact pydantic JSON). Every other chunk has "usage":null.
USAGE_CHUNK = b'"choices":[],"usage":{'
# Asked of the server for a stream whose client did not set stream_options (the learner's sample).
ASK_USAGE = b'"stream_options":{"include_usage":true}'


def parse_loads(body: Any) -> tuple[int, int] | None:
    """(running, waiting) summed over DP ranks from /v1/loads' body (0.5.23 and 0.5.10
    shapes). Raises ValueError when the body is not JSON."""
    loads = json.loads(body) if isinstance(body, bytes | str) else body
    if not isinstance(loads, dict) or not isinstance(loads.get("loads"), list):
        return None
    running = waiting = 0
    for rank in loads["loads"]:
        if isinstance(rank, dict):
            running += int(rank.get("num_running_reqs", 0))
            waiting += int(rank.get("num_waiting_reqs", 0))
    return running, waiting


# --- the memory saver -----------------------------------------------------------------------
# The turns (issue 19, gateway/turns) pause one server's generation and hand its GPU memory to
# the other, with SGLang's answers:
#
#     POST /pause_generation {"mode": "retract"}      http_server.py:1831-1841: 200 with
#                                                     {"message": ..., "status": "ok"}
#     POST /release_memory_occupation {"tags": null}  http_server.py:1575-1584: 200 with body
#     POST /resume_memory_occupation {"tags": null}   null (tags null: every region,
#                                                     weight_updater.py:344-346); an error:
#                                                     {"error": {"message": ...}}, 400
#     POST /continue_generation {}                    http_server.py:1844-1854: 200
#     GET /ready                                      http_server.py:714-718: 503 while paused
#     GET /ping                                       http_server.py:2190-2199: 200 paused too
#     GET /server_info                                answered by the scheduler, after any
#                                                     control call sent before it
#     POST /generate                                  meta_info.spec_accept_length
#                                                     (tokenizer_manager.py:3149)
#
# The four memory-saver endpoints are ADMIN_OPTIONAL (utils/auth.py:133-147): `admin_headers`.

ALL_TAGS = b'{"tags":null}'
# HiCache's backup counters on /metrics (the sample lines: name, labels, value)
HOST_BACKUPS = (b"sglang:hicache_backup_tokens_total{", b"sglang:hicache_backup_tokens_total ")
STORE_BACKUPS = (b"sglang:backuped_tokens_total{", b"sglang:backuped_tokens_total ")
# A short greedy generation to read the accept length after a resume into MTP: with drafts
# that came back wrong (sglang #31674) it is ~1.0, with good ones near its usual value.
# Streamed: each event's meta_info carries the request's figures so far, the last one all.
SPECULATION_PROBE = json.dumps({
    "text": "Count from one to twenty: one, two, three,", "stream": True,
    "sampling_params": {"max_new_tokens": 32, "temperature": 0.0}}).encode()


class MemorySaver:
    """The control calls to one SGLang server of a turns pair."""

    def __init__(self, upstream: Upstream, target: Backend, name: str) -> None:
        self.upstream = upstream
        self.target = target
        self.name = name
        self._admin = admin_headers(target)
        self._user = probe_headers(target)

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
        try:
            status, body = await self._call("GET", SERVER_INFO, None, timeout_s, self._user)
        except CallFailed:
            return Probe(alive=True, ready=ready, scheduler_answers=False)
        saver = memory_saver_flag(body) if status == 200 else None
        return Probe(alive=True, ready=ready, scheduler_answers=status == 200, memory_saver=saver)

    async def busy(self, timeout_s: float) -> int | None:
        """Requests running or waiting there, every client's (/v1/loads); None: it cannot say."""
        try:
            status, body = await self._call("GET", "/v1/loads", None, timeout_s, self._user)
            loads = parse_loads(body) if status == 200 else None
        except (CallFailed, ValueError, TypeError):
            return None
        return None if loads is None else sum(loads)

    async def cache_backups(self, timeout_s: float) -> tuple[float, float] | None:
        """Tokens the server has backed up from its GPUs to host memory and from there to its
        store (HiCache's `sglang:hicache_backup_tokens_total`, every pool, and
        `sglang:backuped_tokens_total`: observability/metrics_collector.py:2219-2222,
        :2595-2604), summed over its ranks; None: no HiCache (neither counter) or no metrics."""
        status, body = await self._call("GET", "/metrics", None, timeout_s, self._user)
        if status != 200:
            return None
        host = store = 0.0
        seen = False
        for line in body.splitlines():
            if line.startswith(HOST_BACKUPS) or line.startswith(STORE_BACKUPS):
                with contextlib.suppress(ValueError, IndexError):
                    value = float(line.rsplit(None, 1)[1])
                    seen = True
                    if line.startswith(HOST_BACKUPS):
                        host += value
                    else:
                        store += value
        return (host, store) if seen else None

    async def accept_length(self, timeout_s: float) -> float | None:
        """The accept length of one short greedy generation (None: not a speculative server,
        or no figure in its answer)."""
        status, body = await self._call("POST", "/generate", SPECULATION_PROBE, timeout_s,
                                        self._user)
        if status != 200:
            raise CallFailed("error", f"{self.name} /generate answered {status}")
        events = [line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")]
        events = [event for event in events if event and event != b"[DONE]"]
        try:
            meta = json.loads(events[-1]).get("meta_info") or {}
        except (ValueError, AttributeError, IndexError):
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
        return await control_call(self.upstream, self.target, self.name, method, path, body,
                                  timeout_s, auth)


def control(upstream: Upstream, target: Backend, name: str) -> MemorySaver:
    """The turns controller's calls to one server of the pair (gateway/turns/steps.py)."""
    return MemorySaver(upstream, target, name)


async def control_call(upstream: Upstream, target: Backend, name: str, method: str, path: str,
                       body: bytes | None, timeout_s: float,
                       auth: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """One control call to a server, its failures as CallFailed (any engine's)."""
    headers = [(b"content-type", b"application/json"), *auth] if body is not None else auth
    try:
        return await upstream.request(method, target.url + path, headers, body, timeout_s)
    except UpstreamTimeout as exc:
        refused = exc.kind == "timeout_connect"
        raise CallFailed("timeout" if not refused else "gone", f"{name} {path}: "
                         f"{exc.message}", sent=not refused) from None
    except UpstreamConnectError as exc:
        # Refused at connect: nothing was sent. Closed before answering: it may have been.
        refused = exc.message.startswith("cannot connect")
        raise CallFailed("gone", f"{name} {path}: {exc.message}",
                         sent=not refused) from None
    except GatewayError as exc:  # broken mid-answer
        raise CallFailed("gone", f"{name} {path}: {exc.message}") from None


def _message(answer: bytes) -> str:
    try:
        error = json.loads(answer).get("error") or {}
        return str(error.get("message", ""))[:300]
    except (ValueError, AttributeError):
        return answer[:300].decode("utf-8", "replace")

