"""SGLang 0.5.23, as the gateway uses it (paths relative to sglang/srt/). See
gateway/engine/__init__.py for what this module provides and why it is one place."""

from __future__ import annotations

import itertools
import json
import logging
import secrets
from typing import Any

from gateway.config import Backend
from gateway.errors import GatewayError
from gateway.upstream import Header, Upstream

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


def parse_loads(loads: Any) -> tuple[int, int] | None:
    """(running, waiting) summed over DP ranks from /v1/loads (0.5.23 and 0.5.10 shapes)."""
    if not isinstance(loads, dict) or not isinstance(loads.get("loads"), list):
        return None
    running = waiting = 0
    for rank in loads["loads"]:
        if isinstance(rank, dict):
            running += int(rank.get("num_running_reqs", 0))
            waiting += int(rank.get("num_waiting_reqs", 0))
    return running, waiting


# --- the memory saver -----------------------------------------------------------------------
# The turns (issue 19) pause one server's generation and hand its GPU memory to the other:
# /pause_generation, /release_memory_occupation, /resume_memory_occupation and
# /continue_generation (http_server.py:1831, :1575, :1587, :1844), all ADMIN_OPTIONAL like
# /abort_request. Their calls go here, each an async function of (upstream, target, ...) like
# `abort`, sending `admin_headers(target)`.
