"""vLLM 0.33.0, as the gateway would use it (paths relative to vllm/ in the 0.33.0 wheel): the
seam's names (gateway/upstream/engine/__init__.py) for the second engine, and the sleep-mode
calls a turns pair of vLLM servers needs. docs/compat.md's vLLM section has each behaviour.

What differs from SGLang, and where the gateway must act on it:

- No abort endpoint outside dev mode (entrypoints/rl/online/api_router.py:97 is a dev route):
  a request is aborted by closing its connection (entrypoints/serve/utils/api_utils.py:53-100,
  v1/engine/async_llm.py:805-812), which the relay already does first. So ``abort`` sends
  nothing and ``abort_rids`` names nothing.
- The request id is the ``X-Request-Id`` header (entrypoints/serve/engine/serving.py:133-142),
  not a body field: nothing is spliced into the body.
- The load is on ``/metrics`` (Prometheus text), not a JSON endpoint: ``parse_loads`` takes the
  text. The running cap is in ``/server_info?config_format=json`` (dev mode only,
  entrypoints/serve/dev/server_info/api_router.py:43-60); there is no accept length there.
- ``/health`` stays 200 while the server sleeps (v1/engine/async_llm.py:1129-1134): a
  sleeping server is known from the gateway's own state (what it sent) and ``/is_sleeping``,
  never from the health probe.

Chosen per pair by ``engine: vllm`` (``Settings.engine_of``; the core looks the module up with
gateway/upstream/engine/seam.py ``engine_of``). The turns controller drives :class:`SleepControl`
with the steps of gateway/turns/state.py's vLLM plan (docs/turns.md, "vLLM: sleep mode").
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from gateway.config import Backend
from gateway.upstream.client import Header, Upstream
from gateway.upstream.engine.probe import CallFailed, Probe, SaverReport
from gateway.upstream.engine.sglang import answer_of, control_call, new_rid, probe_headers

__all__ = ["ABORT", "ASK_USAGE", "HEALTH", "HEALTH_GENERATE", "LOADS", "MODELS", "NOT_PROVIDED", "READY",
           "RESPONSE_ID_PREFIX", "RID_FIELDS", "RID_HEADER", "RID_HEADER_PATHS", "SERVER_INFO", "USAGE_CHUNK",
           "CallFailed", "SleepControl", "abort", "abort_rids", "admin_headers", "control", "new_rid",
           "parse_loads", "parse_server_info", "probe_headers", "read_memory_saver", "sleep_mode_report",
           "usage_by_default"]  # fmt: skip

# --- request ids ----------------------------------------------------------------------------

# The Responses request's ``request_id`` is the response's id (entrypoints/openai/responses/
# protocol.py:357-364, :989), as in SGLang; other requests take their id from X-Request-Id.
RID_FIELDS = {"/v1/responses": "request_id"}
RESPONSE_ID_PREFIX = "resp_"  # a Responses id (previous_response_id names one)
RID_HEADER = b"x-request-id"  # entrypoints/serve/engine/serving.py:133-142, every API
RID_HEADER_PATHS: frozenset[str] = frozenset()  # nothing to abort by name, so none is sent


def abort_rids(rid: str | None, samples: int, batch: int | None) -> tuple[str, ...]:
    """No rid is aborted by name: closing the connection aborts the request."""
    return ()


# --- aborts ---------------------------------------------------------------------------------

ABORT = None  # no abort endpoint outside VLLM_SERVER_DEV_MODE


def admin_headers(target: Backend) -> list[Header]:
    """vLLM has one key (--api-key) for every /v1 route; the admin key is SGLang's."""
    return probe_headers(target)


async def abort(upstream: Upstream, target: Backend, name: str, rid: str) -> None:
    """Nothing to send: the relay closed the upstream connection, and vLLM aborts a request
    whose client left (entrypoints/serve/utils/api_utils.py:53-100)."""


# --- what the monitor reads -----------------------------------------------------------------

LOADS = "/metrics"  # v1/metrics/loggers.py:527-545: running and waiting gauges
SERVER_INFO = "/server_info?config_format=json"  # dev mode only: the engine's configuration
MODELS = "/v1/models"
# /health: 200 unless the engine is dead (instrumentator/health.py:22-33), asleep or not. There
# is no generation probe and no readiness endpoint; /is_sleeping (dev mode) says asleep.
HEALTH, HEALTH_GENERATE, READY = "/health", "/health", "/is_sleeping"
NOT_PROVIDED = (404, 405)

# The usage chunk of a chat or completions stream is dumped with exclude_none
# (chat_completion/serving.py:905-918): the same bytes as SGLang's.
USAGE_CHUNK = b'"choices":[],"usage":{'
ASK_USAGE = b'"stream_options":{"include_usage":true}'

_GAUGE = re.compile(rb"^vllm:num_requests_(running|waiting)\{[^}]*\} ([0-9.eE+-]+)$", re.MULTILINE)


def parse_loads(metrics: bytes | str | Any) -> tuple[int, int] | None:
    """(running, waiting) summed over engines from /metrics' Prometheus text; None when it has
    neither gauge (not vLLM, or metrics off)."""
    if isinstance(metrics, str):
        metrics = metrics.encode()
    if not isinstance(metrics, bytes):
        return None
    totals = {b"running": 0.0, b"waiting": 0.0}
    found = False
    for kind, value in _GAUGE.findall(metrics):
        totals[kind] += float(value)
        found = True
    return (int(totals[b"running"]), int(totals[b"waiting"])) if found else None


def parse_server_info(info: Any) -> tuple[int | None, float | None]:
    """(running cap, accept length) from /server_info?config_format=json: the scheduler's
    max_num_seqs (vllm_config.scheduler_config); vLLM reports no accept length there (the
    spec-decode counters on /metrics carry it)."""
    if not isinstance(info, dict) or not isinstance(info.get("vllm_config"), dict):
        return None, None
    scheduler = info["vllm_config"].get("scheduler_config")
    cap = scheduler.get("max_num_seqs") if isinstance(scheduler, dict) else None
    return (int(cap) if isinstance(cap, int) else None), None


def usage_by_default(info: Any) -> bool:
    """--enable-force-include-usage is a server flag, not in vllm_config: not known."""
    return False


# --- sleep mode -----------------------------------------------------------------------------
# Whether a server can take turns (`memory: auto`, gateway/turns/shape.py): it needs both
# --enable-sleep-mode (ModelConfig.enable_sleep_mode, config/model.py:370; without it the
# weights and KV cache are not in the cuMem pools a sleep frees, v1/worker/gpu_worker.py:396-417,
# and a sleep frees nothing) and VLLM_SERVER_DEV_MODE=1 (the only way /sleep and /wake_up exist,
# entrypoints/launchers/api_server/routers.py:46-53). Dev mode's /server_info?config_format=json
# dumps the engine's whole configuration (dev/server_info/api_router.py:43-60), sleep mode in
# vllm_config.model_config.enable_sleep_mode; without dev mode there is no /server_info (404).
# /is_sleeping cannot tell: in dev mode it answers false with or without sleep mode
# (v1/engine/core.py:1078-1080, v1/executor/abstract.py:397-398).
SLEEP_MODE_FIELD = ("vllm_config", "model_config", "enable_sleep_mode")


def sleep_mode_report(status: int | None, body: bytes) -> SaverReport:
    """What a /server_info?config_format=json answer says of sleep mode (status None: no
    answer): 404/405 is a server without dev mode, which can neither say nor sleep."""
    if status is None or (status != 200 and status not in NOT_PROVIDED):
        return "silent"  # not up yet: asked again
    if status != 200:
        return "no_controls"
    found: Any = _json(body)
    for key in SLEEP_MODE_FIELD:
        found = found.get(key) if isinstance(found, dict) else None
    return "unsaid" if not isinstance(found, bool) else "on" if found else "off"


async def read_memory_saver(upstream: Upstream, target: Backend, timeout_s: float) -> SaverReport:
    """Ask one server's dev-mode /server_info whether it runs in sleep mode (answered by its API
    server from the configuration, asleep or not)."""
    return sleep_mode_report(*await answer_of(upstream, target, SERVER_INFO, timeout_s))


# A turns pair of vLLM servers, both launched with VLLM_SERVER_DEV_MODE=1 --enable-sleep-mode:
#
#     POST /sleep?level=1&mode=keep   dev/sleep/api_router.py:26-34: {"status":"sleeping",
#                                     "level":1} once asleep; level 1 only (level 2 loses the
#                                     MTP draft, vLLM issue #52479); keep: running requests
#                                     are recomputed after the wake (v1/engine/core.py:993-1028)
#     POST /wake_up                   :44-55: {"status":"awake","tags":null}; a 500 when the
#                                     memory is not free (core.py:1848-1851): still asleep
#     GET /is_sleeping                :58-61: {"is_sleeping": bool}
#
# Unlike SGLang's memory saver nothing here kills the server: a second sleep or a wake while
# awake changes nothing (v1/executor/abstract.py:400-415). But requests sent while it sleeps
# wait there without end (core.py:958-970): the gateway must hold them itself.
#
# The mode of a turn's sleep is `abort`: by then the gateway's streams on the server have
# finished (or were ended, past turns.finish_within_s), so what is left is work nobody waits
# for, or another client's; `abort` ends it at once with finish_reason "abort" (core.py:976-977).
# `wait` would hold the turn (and the sleep call) for as long as the longest of them runs, and
# `keep` would freeze them until this server wakes again, a turn later: a client hung for a
# whole dwell (core.py:1006-1008).
SLEEP_MODE = "abort"

# vLLM's spec-decode counters (v1/spec_decode/metrics.py:228-262), exported with `_total`: the
# mean acceptance length is 1 + accepted tokens / drafts (:114)
DRAFTS = b"vllm:spec_decode_num_drafts_total"
ACCEPTED = b"vllm:spec_decode_num_accepted_tokens_total"
# A short greedy completion whose drafts the counters count (no `model`: the served one,
# entrypoints/serve/engine/serving.py:85-90)
SPECULATION_PROBE = json.dumps({"prompt": "Count from one to twenty: one, two, three,",
                                "max_tokens": 32, "temperature": 0.0}).encode()


def control(upstream: Upstream, target: Backend, name: str) -> SleepControl:
    """The turns controller's calls to one server of the pair (gateway/turns/steps.py)."""
    return SleepControl(upstream, target, name)


class SleepControl:
    """The sleep-mode calls to one vLLM server of a turns pair."""

    def __init__(self, upstream: Upstream, target: Backend, name: str) -> None:
        self.upstream = upstream
        self.target = target
        self.name = name
        self._headers = probe_headers(target)

    async def sleep(self, timeout_s: float, mode: str = SLEEP_MODE) -> None:
        status, body = await self._call("POST", f"/sleep?level=1&mode={mode}", timeout_s)
        self._expect(status, body, "/sleep", {"status": "sleeping", "level": 1})

    async def wake_up(self, timeout_s: float) -> None:
        status, body = await self._call("POST", "/wake_up", timeout_s)
        self._expect(status, body, "/wake_up", {"status": "awake", "tags": None})

    async def is_sleeping(self, timeout_s: float) -> bool:
        status, body = await self._call("GET", "/is_sleeping", timeout_s)
        answer = _json(body) if status == 200 else None
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            raise CallFailed("error", f"{self.name} /is_sleeping answered {status}")
        return bool(answer["is_sleeping"])

    async def probe(self, timeout_s: float) -> Probe:
        """alive: /health 200 (a sleeping server is alive too); asleep: /is_sleeping, whose
        answer comes from the engine core after any sleep or wake sent before it. No
        /is_sleeping (404: no VLLM_SERVER_DEV_MODE): awake, and it cannot sleep. Whether a sleep
        frees anything: /server_info's sleep mode (None where it does not say)."""
        try:
            status, _ = await self._call("GET", HEALTH, timeout_s)
        except CallFailed:
            return Probe(alive=False)
        if status != 200:
            return Probe(alive=False)
        try:
            status, body = await self._call("GET", "/is_sleeping", timeout_s)
        except CallFailed:  # the engine core is in a call that has not finished
            return Probe(alive=True, scheduler_answers=False)
        if status in NOT_PROVIDED:
            return Probe(alive=True, ready=True, scheduler_answers=True, memory_saver=False,
                         asleep=False)
        answer = _json(body) if status == 200 else None
        if not isinstance(answer, dict) or not isinstance(answer.get("is_sleeping"), bool):
            return Probe(alive=True, scheduler_answers=False)
        asleep = bool(answer["is_sleeping"])
        sleep_mode = await read_memory_saver(self.upstream, self.target, timeout_s)
        return Probe(alive=True, ready=not asleep, scheduler_answers=True,
                     memory_saver={"on": True, "off": False}.get(sleep_mode), asleep=asleep)

    async def ready(self, timeout_s: float) -> bool:
        """Awake and serving: /health 200 says only that the engine lives, so /is_sleeping
        says the rest."""
        probe = await self.probe(timeout_s)
        return probe.alive and probe.asleep is False

    async def busy(self, timeout_s: float) -> int | None:
        """Requests running or waiting there, every client's (/metrics); None: it cannot say."""
        try:
            status, body = await self._call("GET", LOADS, timeout_s)
        except CallFailed:
            return None
        loads = parse_loads(body) if status == 200 else None
        return None if loads is None else sum(loads)

    async def accept_length(self, timeout_s: float) -> float | None:
        """The mean acceptance length of one short greedy completion, from the spec-decode
        counters before and after it (None: not a speculative server, or nothing drafted)."""
        before = await self._drafts(timeout_s)
        if before is None:
            return None
        status, _ = await self._call("POST", "/v1/completions", timeout_s, SPECULATION_PROBE)
        if status != 200:
            raise CallFailed("error", f"{self.name} /v1/completions answered {status}")
        after = await self._drafts(timeout_s)
        if after is None or after[0] <= before[0]:
            return None
        return 1.0 + (after[1] - before[1]) / (after[0] - before[0])

    async def _drafts(self, timeout_s: float) -> tuple[float, float] | None:
        """(drafts, accepted tokens) summed over engines; None without the counters."""
        status, body = await self._call("GET", LOADS, timeout_s)
        if status != 200:
            return None
        totals = {DRAFTS: 0.0, ACCEPTED: 0.0}
        seen = False
        for line in body.splitlines():
            for name in totals:
                if line.startswith(name) and line[len(name):len(name) + 1] in (b"{", b" "):
                    with contextlib.suppress(ValueError, IndexError):
                        totals[name] += float(line.rsplit(None, 1)[1])
                        seen = True
        return (totals[DRAFTS], totals[ACCEPTED]) if seen else None

    def _expect(self, status: int, body: bytes, path: str, wanted: dict[str, Any]) -> None:
        if status != 200 or _json(body) != wanted:
            message = ""
            with contextlib.suppress(AttributeError, TypeError):
                message = str(_json(body).get("error", {}).get("message", ""))[:300]
            raise CallFailed("error", f"{self.name} {path} answered {status}: "
                             f"{message or body[:200].decode('utf-8', 'replace')}")  # fmt: skip

    async def _call(self, method: str, path: str, timeout_s: float,
                    body: bytes | None = None) -> tuple[int, bytes]:
        return await control_call(self.upstream, self.target, self.name, method, path, body,
                                  timeout_s, self._headers)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
