"""Broken and hostile clients: generated bad requests, raw protocol abuse, credentials.

The property tests drive a live gateway (real uvicorn socket, simulated pair behind it) from
synchronous hypothesis tests through a private event loop (`Harness`), so every example is a
real HTTP request and the checks after the run (nothing in flight, still serving, bounded
metric labels) see the same gateway. Every generated request is a client mistake: the answer
must be the 4xx the mistake deserves, OpenAI-shaped, never a 5xx, never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import re
import socket
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter, ValidationError

from gateway.apis import ANTHROPIC_API, PROXY_PATHS, PUT_PATHS, api_of
from gateway.app import create_app
from gateway.front.server import uvicorn_config
from gateway.sim.faults import Faults
from gateway.sim.server import SimOptions, start_sim_pair
from tests.conftest import LiveGateway, gateway_settings, live_gateway
from tests.live import serve_app, wait_until
from tests.test_gateway_live import chat, sse_events
from tests.test_reliability import FakeBackend

MODEL = "Qwen/Qwen3.5-122B-A10B"
MAX_BODY = 1024  # limits.max_body_bytes for these gateways: huge bodies stay cheap to send
PROXY = sorted(PROXY_PATHS)
GET_ROUTES = ["/health", "/metrics", "/v1/models", "/admin/state", "/dashboard",
              "/dashboard/state"]
KNOWN = {*PROXY, *GET_ROUTES, "/admin/routing", "/"}  # "/": SGLang's root, answered
JSON = (b"content-type", b"application/json")
ERROR_KEYS = {"message", "type", "param", "code"}


def valid_body(path: str) -> dict[str, Any]:
    """A request the backend would serve (max one token: the few that get through are quick)."""
    user = [{"role": "user", "content": "hi"}]
    return {
        "/v1/chat/completions": {"model": MODEL, "messages": user, "max_tokens": 1},
        "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
        "/v1/messages": {"model": MODEL, "messages": user, "max_tokens": 1},
        "/v1/messages/count_tokens": {"model": MODEL, "messages": user},
        "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1},
        "/v1/embeddings": {"model": MODEL, "input": "hi"},
    }.get(path, {"model": MODEL, "text": "hi"})


def assert_error_in_api_shape(response: httpx.Response, path: str) -> None:
    """/v1/messages answers in Anthropic's envelope, every other path in OpenAI's."""
    if api_of(path) != ANTHROPIC_API:
        assert_openai_error(response)
        return
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and isinstance(error["code"], str)
    return error


# --- a live gateway driven from synchronous hypothesis tests -------------------------------------

class Harness:
    """The simulated pair and a live gateway in a private event loop, with a pooled client.

    The loop runs only inside `run()`; hypothesis generates examples between runs."""

    def __init__(self, *, sim: bool = False, **sections: dict[str, Any]) -> None:
        self.sim = sim  # the simulated pair, or one quick scripted backend for both
        self.sections = sections
        self.runner = asyncio.Runner()
        self.stack = contextlib.AsyncExitStack()
        self.gateway: LiveGateway
        self.client: httpx.AsyncClient

    def run(self, coroutine: Any) -> Any:
        return self.runner.run(coroutine)

    async def _start(self) -> None:
        if self.sim:
            pair = await self.stack.enter_async_context(start_sim_pair(SimOptions(speed=50)))
            gateway = live_gateway(pair, **self.sections)
        else:
            url = await self.stack.enter_async_context(serve_app(FakeBackend().app))
            backends = {"mtp": {"url": url}, "plain": {"url": url}}
            gateway = live_gateway(None, **{"backends": backends, **self.sections})
        self.gateway = await self.stack.enter_async_context(gateway)
        await self.gateway.runtime.probes.probe_all()
        self.client = await self.stack.enter_async_context(
            httpx.AsyncClient(base_url=self.gateway.url, timeout=5.0))

    def __enter__(self) -> Harness:
        self.runner.__enter__()
        self.run(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stack.aclose())
        finally:
            self.runner.__exit__(*exc)

    async def still_serving(self, headers: dict[str, str] | None = None) -> None:
        """Nothing in flight, no abort pending, and a real stream still goes through."""
        router = self.gateway.pool
        await wait_until(lambda: router.concurrency == 0, timeout=5)
        await wait_until(lambda: not self.gateway.runtime.proxy.aborts.background, timeout=5)
        response = await self.client.post("/v1/chat/completions", headers=headers,
                                          json=chat(max_tokens=5, stream=True))
        assert response.status_code == 200 and sse_events(response.content)[-1] == "[DONE]"
        assert self.gateway.inflight() == {"mtp": 0, "plain": 0}

    async def metric_labels(self) -> set[str]:
        text = (await self.client.get("/metrics")).text
        return {value for family in text_string_to_metric_families(text)
                if family.name.startswith("gateway_")
                for sample in family.samples for value in sample.labels.values()}


# --- generated bad requests ----------------------------------------------------------------------

@dataclass(frozen=True)
class Bad:
    kind: str
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes | tuple[bytes, ...]  # a tuple is sent chunked (no Content-Length)
    expect: frozenset[int]


def bad(kind: str, path: str, body: bytes | tuple[bytes, ...], expect: set[int], *,
        method: str = "POST", headers: tuple[tuple[bytes, bytes], ...] = (JSON,)) -> Bad:
    return Bad(kind, method, path, headers, body, frozenset(expect))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                               max_size=3),
    max_leaves=6)
header_bytes = st.binary(max_size=60).map(
    lambda b: bytes(c for c in b if 0x21 <= c <= 0x7e or c >= 0x80))  # legal field-value octets
token = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.!#$%&'*+^`|~", min_size=1, max_size=20)


@st.composite
def malformed_json(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from(PROXY))
    text = json.dumps(valid_body(path)).encode()
    body = draw(st.one_of(
        st.integers(0, len(text) - 1).map(lambda cut: text[:cut]),  # truncated: never valid
        st.binary(max_size=80).map(lambda b: b"x" + b),  # no JSON text starts with x
        json_values.filter(lambda v: not isinstance(v, dict)).map(lambda v: json.dumps(v).encode()),
    ))
    return bad("malformed_json", path, body, {400})


WRONG_TYPES = [b"text/plain", b"application/x-www-form-urlencoded",
               b"multipart/form-data; boundary=x", b"application/jsonl", b"application/json-seq",
               b"application/problem+json", b"json", b"application", b"*/*", b"text/json"]


@st.composite
def wrong_content_type(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from(PROXY))
    value = draw(st.sampled_from(WRONG_TYPES) | header_bytes)
    if value.decode("latin-1").split(";", 1)[0].strip().lower() == "application/json":
        value = b"text/plain"
    headers = () if draw(st.booleans()) else ((b"content-type", value),)  # or none at all
    return bad("wrong_content_type", path, json.dumps(valid_body(path)).encode(), {415},
               headers=headers)


@st.composite
def wrong_fields(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from([p for p, field in PROXY_PATHS.items() if field]))
    body = valid_body(path)
    required = PROXY_PATHS[path]
    assert required is not None
    choices = ["missing", "stream", "model"] + (["messages"] if path == "/v1/chat/completions" else [])
    mutation = draw(st.sampled_from(choices))
    if mutation == "missing":
        body.pop(required)
    elif mutation == "stream":
        body["stream"] = draw(json_values.filter(lambda v: v is not None and not _lax_bool(v)))
    elif mutation == "model":
        body["model"] = draw(json_values.filter(lambda v: v is not None and not isinstance(v, str)))
    else:
        body["messages"] = draw(json_values.filter(lambda v: not isinstance(v, list)))
    return bad(f"wrong_fields_{mutation}", path, json.dumps(body).encode(), {400})


@st.composite
def too_large(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from(PROXY))
    size = draw(st.integers(MAX_BODY + 1, MAX_BODY * 8))
    filler = draw(st.sampled_from([b" ", b"a", b"\xff", b"{"]))
    body = json.dumps(valid_body(path)).encode()
    body = (body[:-1] + b', "pad": "' + filler * size + b'"}') if filler != b" " else body + b" " * size
    if draw(st.booleans()):  # chunked, no Content-Length: the limit must hold while reading
        parts = draw(st.integers(2, 6))
        step = len(body) // parts + 1
        return bad("too_large_chunked", path, tuple(body[i:i + step] for i in range(0, len(body), step)),
                   {413})
    return bad("too_large", path, body, {413})


@st.composite
def unknown_path(draw: st.DrawFn) -> Bad:
    tail = draw(st.text("abcdefghijklmnopqrstuvwxyz0123456789-._~/%:@!$&'()*+,;=", max_size=40)
                .filter(lambda t: not t.startswith("/")))  # "//host/..." is another host to httpx
    path = "/" + tail
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    sent = unquote(httpx.URL("http://x" + path).raw_path.decode())
    if sent in KNOWN:
        return draw(malformed_json())  # rarely drawn: a real route, not an unknown one
    # Starlette redirects /known/ to /known: not an error, and to the same host.
    expect = {307} if sent.endswith("/") and sent.rstrip("/") in KNOWN else {404}
    return bad("unknown_path", path, b"{}", expect, method=method)


@st.composite
def wrong_method(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from([*PROXY, *GET_ROUTES, "/admin/routing"]))
    allowed = ({"POST", "PUT"} if path in PUT_PATHS else {"POST"} if path in PROXY_PATHS
               else {"PUT"} if path == "/admin/routing" else {"GET", "HEAD"})
    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"]
    method = draw(st.sampled_from([m for m in methods if m not in allowed]))
    return bad("wrong_method", path, json.dumps(valid_body(path)).encode(), {405}, method=method)


INVALID_UTF8 = [b"\xff", b"\xfe", b"\xc0\xaf", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xe2\x82",
                b"\xed\xa0\x80", b"\xf0\x28\x8c\xbc", b"\xf8\xa1\xa1\xa1\xa1", b"\xf4\x90\x80\x80"]


@st.composite
def invalid_utf8(draw: st.DrawFn) -> Bad:
    path = draw(st.sampled_from(PROXY))
    text = json.dumps(valid_body(path)).encode()
    junk = draw(st.sampled_from(INVALID_UTF8)) + draw(st.binary(max_size=8))
    where = draw(st.sampled_from([b'"hi"', b'"model"', MODEL.encode()]))
    if where not in text:
        where = b'"model"'
    body = text.replace(where, where[:2] + junk + where[2:], 1)
    try:
        body.decode("utf-8")  # the random tail may have completed the sequence
        body = text.replace(where, where[:2] + b"\xff" + where[2:], 1)
    except UnicodeDecodeError:
        pass
    return bad("invalid_utf8", path, body, {400})


def _lax_bool(value: Any) -> bool:
    """A `stream` value SGLang's pydantic models take as a boolean ("true", 1, "yes", ...)."""
    try:
        TypeAdapter(bool).validate_python(value)
    except ValidationError:
        return False
    return True


@st.composite
def unknown_model(draw: st.DrawFn) -> Bad:
    """Not a mistake at the gateway: SGLang serves any model name on chat and completions
    (serving_base.py:40-60), so the gateway passes it through (a 404 here before)."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    body = valid_body(path)
    body["model"] = draw(st.text(min_size=1, max_size=40).filter(lambda m: m != MODEL))
    return bad("unknown_model", path, json.dumps(body).encode(), {200})


FRAMING = {"content-length", "transfer-encoding", "host", "connection", "upgrade", "expect", "te",
           "trailer", "content-type", "keep-alive", "http2-settings"}


@st.composite
def weird_headers(draw: st.DrawFn) -> Bad:
    """A valid request with strange headers: served normally, or 400 for a bad pin."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    names = st.one_of(token.filter(lambda n: n.lower() not in FRAMING),
                      st.sampled_from(["x-session-id", "x-claude-code-session-id", "thread-id",
                                       "authorization", "x-api-key", "cookie", "x-gateway-pin",
                                       "x-forwarded-host", "forwarded", "proxy-authorization"]))
    values = st.one_of(header_bytes, st.integers(1, 8000).map(lambda n: b"v" * n),
                       st.sampled_from([b"mtp", b"plain", b"MTP", b"Bearer", b"Bearer \xff\xfe"]))
    extra = draw(st.lists(st.tuples(names, values), max_size=12))
    headers = tuple((name.lower().encode(), value) for name, value in extra)
    pins = [value for name, value in headers if name == b"x-gateway-pin"]
    ok = not pins or pins[0] in (b"mtp", b"plain")
    return bad("weird_headers", path, json.dumps(valid_body(path)).encode(), {200 if ok else 400},
               headers=(JSON, *headers))


bad_requests = st.one_of(malformed_json(), wrong_content_type(), wrong_fields(), too_large(),
                         unknown_path(), wrong_method(), invalid_utf8(), unknown_model(),
                         weird_headers())


async def send(client: httpx.AsyncClient, request: Bad) -> httpx.Response:
    content: Any = request.body
    if isinstance(request.body, tuple):
        parts = request.body

        async def chunked() -> Any:
            for part in parts:
                yield part
        content = chunked()
    return await client.request(request.method, request.path, content=content,
                                headers=list(request.headers))


async def check(client: httpx.AsyncClient, request: Bad) -> None:
    response = await send(client, request)
    status = response.status_code
    assert status < 500, (status, response.text[:300])
    assert status in request.expect, (status, response.text[:300])
    if status == 200:
        return
    if status == 307:  # to the same gateway, never to a host of the client's choosing
        location = httpx.URL(response.headers["location"])
        assert (location.host, location.port) == (client.base_url.host, client.base_url.port)
        return
    if status == 405:
        assert "allow" in response.headers
    if request.method != "HEAD":
        assert_error_in_api_shape(response, request.path)


@pytest.mark.timeout(120)
def test_generated_bad_requests_get_openai_shaped_4xx_and_leave_nothing_behind() -> None:
    sections = {"limits": {"max_body_bytes": MAX_BODY},
                "routing": {"allow_pin_header": True, "max_sessions": 16}}
    kinds: Counter[str] = Counter()
    with Harness(**sections) as harness:
        labels_before = harness.run(harness.metric_labels())

        @settings(max_examples=1600, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(bad_requests)
        def one(request: Bad) -> None:
            kinds[request.kind] += 1
            harness.run(check(harness.client, request))

        one()
        harness.run(harness.still_serving())
        labels = harness.run(harness.metric_labels())
        # Label values are a small fixed vocabulary: nothing the client chose becomes a series.
        assert all(re.fullmatch(r"[A-Za-z0-9_.+]+", value) for value in labels), labels - labels_before
        assert len(labels) < 80, sorted(labels)
        assert len(harness.gateway.pool.sessions) <= 16
    assert sum(kinds.values()) >= 1600  # + 300 keys + 150 routing changes: 2,050 in all
    categories = {"malformed_json", "wrong_content_type", "wrong_fields", "too_large",
                  "unknown_path", "wrong_method", "invalid_utf8", "unknown_model", "weird_headers"}
    assert {c for c in categories if any(k.startswith(c) for k in kinds)} == categories, kinds


@pytest.mark.timeout(60)
def test_client_keys_only_exact_matches_pass() -> None:
    keys = ("sk-live-alpha-0123456789", "sk-live-beta-9876543210")
    near = st.sampled_from(keys).flatmap(lambda key: st.one_of(
        st.integers(0, len(key) - 1).map(lambda cut: key[:cut]),  # prefixes
        st.text(min_size=1, max_size=3).map(lambda extra: key + extra),  # longer
        st.just(key.upper()), st.just(" " + key + "x"), st.just(key[::-1]),
        st.integers(0, len(key) - 1).map(lambda i: key[:i] + chr(ord(key[i]) ^ 1) + key[i + 1:]),
    ))
    tokens = st.one_of(near, st.text(max_size=40), st.sampled_from(keys))
    schemes = st.sampled_from(["bearer", "x-api-key", "basic", "raw"])
    seen: Counter[bool] = Counter()
    with Harness(auth={"api_keys": list(keys)}) as harness:

        @settings(max_examples=300, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(tokens, schemes)
        def one(given_key: str, scheme: str) -> None:
            # No whitespace or control octets: HTTP trims the first, forbids the second.
            raw = bytes(c for c in given_key.encode("utf-8") if 0x21 <= c != 0x7f)
            name, value = {"bearer": (b"authorization", b"Bearer " + raw),
                           "x-api-key": (b"x-api-key", raw),
                           "basic": (b"authorization", b"Basic " + raw),
                           "raw": (b"authorization", raw)}[scheme]
            header = (name, value.strip())
            accepted = scheme in ("bearer", "x-api-key") and raw in {k.encode() for k in keys}

            async def go() -> None:
                response = await harness.client.post(
                    "/v1/chat/completions", content=json.dumps(valid_body("/v1/chat/completions")),
                    headers=[JSON, header])
                seen[accepted] += 1
                if accepted:
                    assert response.status_code == 200, response.text
                else:
                    assert response.status_code == 401, (given_key, scheme, response.text)
                    assert assert_openai_error(response)["type"] == "authentication_error"
            harness.run(go())

        one()
        harness.run(harness.still_serving({"authorization": f"Bearer {keys[0]}"}))
    assert seen[True] > 0 and seen[False] > 100, seen


@pytest.mark.timeout(60)
def test_accepted_routing_changes_leave_the_gateway_serving() -> None:
    """PUT /admin/routing with generated changes: 200 or 400, and after every accepted one a
    real request is still served (a bad value that validation let through would 500 here)."""
    admin = [(b"authorization", b"Bearer admin-key")]
    valid_changes = st.fixed_dictionaries({}, optional={
        "policy": st.sampled_from(["crossover", "mtp-only", "plain-only"]),
        "crossover": st.integers(1, 300), "hysteresis": st.integers(0, 20),
        "min_dwell_s": st.floats(0, 60), "capacity_guard": st.booleans(),
        "session_affinity": st.booleans(), "max_sessions": st.integers(1, 10**6),
        "session_headers": st.lists(st.sampled_from(["x-session-id", "thread-id", "x-ok"]),
                                    max_size=3),
        "allow_pin_header": st.booleans(),
    })
    arbitrary_changes = st.fixed_dictionaries({}, optional={
        "policy": st.sampled_from(["crossover", "mtp-only", "plain-only"]) | st.text(max_size=8),
        "crossover": st.integers(-2, 300) | json_values,
        "hysteresis": st.integers(-2, 300) | json_values,
        "min_dwell_s": st.floats(allow_nan=False, allow_infinity=False) | json_values,
        "capacity_guard": st.booleans() | json_values,
        "session_affinity": st.booleans() | json_values,
        "session_headers": st.lists(st.sampled_from(["x-ok", "", "a b", "é", "Ā", "x:y"])
                                    | st.text(max_size=12), max_size=3) | json_values,
        "max_sessions": st.integers(-2, 10**6) | json_values,
        "allow_pin_header": st.booleans(),
        "unknown_key": json_values,
    })
    counts: Counter[int] = Counter()
    with Harness(auth={"admin_key": "admin-key"}) as harness:
        original = harness.gateway.pool.pairs["default"].routing.model_dump(mode="json")

        @settings(max_examples=150, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(valid_changes | arbitrary_changes)
        @example({"session_headers": ["Ā"]})  # not even latin-1: no request can carry it
        @example({"session_headers": ["x-ok", ""], "allow_pin_header": True})
        def one(change: dict[str, Any]) -> None:
            async def go() -> None:
                client = harness.client
                response = await client.put("/admin/routing", json=change, headers=admin)
                try:
                    counts[response.status_code] += 1
                    assert response.status_code in (200, 400), response.text
                    if response.status_code == 400:
                        assert_openai_error(response)
                    served = await client.post("/v1/chat/completions", json=chat(max_tokens=1),
                                               headers={"x-session-id": "s-1", "thread-id": "t"})
                    assert served.status_code == 200, (change, served.text)
                finally:  # each example starts from the same routing
                    restored = await client.put("/admin/routing", json=original, headers=admin)
                    assert restored.status_code == 200
            harness.run(go())

        one()
        harness.run(harness.still_serving())
    assert counts[200] > 30 and counts[400] > 30, counts


# --- raw protocol: the client never picks the upstream, garbage never costs a 5xx ---------------

async def raw_exchange(port: int, data: bytes, timeout: float = 3.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout)  # until the server closes
    except ConnectionError:
        return b""  # reset by the server: refused, not served
    finally:
        writer.close()


def status_of(raw: bytes) -> int | None:
    match = re.match(rb"HTTP/1\.[01] (\d{3}) ", raw)
    return int(match.group(1)) if match else None


@contextlib.asynccontextmanager
async def serve_like_cli(app: Any, settings: Any) -> Any:
    """The gateway app under the uvicorn configuration `mtp-gateway serve` uses."""
    listen = settings.listen.model_copy(update={"port": 0})
    config = uvicorn_config(app, settings.model_copy(update={"listen": listen}), "warning")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done(), timeout=10)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, timeout=10)


def request_bytes(target: bytes, *, method: bytes = b"POST", host: bytes = b"gateway",
                  extra: bytes = b"", body: bytes | None = None) -> bytes:
    body = json.dumps(valid_body("/v1/chat/completions")).encode() if body is None else body
    return (method + b" " + target + b" HTTP/1.1\r\nHost: " + host + b"\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n" + extra +
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


@pytest.mark.timeout(30)
async def test_the_client_never_chooses_the_upstream_address(sim) -> None:
    trap = FakeBackend()  # the address a hostile client would like the gateway to call
    async with serve_app(trap.app) as trap_url:
        there = trap_url.removeprefix("http://").encode()
        settings = gateway_settings(sim, auth={"admin_key": "admin-key"})
        app = create_app(settings, registry=CollectorRegistry())
        async with serve_like_cli(app, settings) as port:
            attempts = [
                request_bytes(b"http://" + there + b"/v1/chat/completions", host=there),
                request_bytes(b"http://" + there + b"/", host=there),
                request_bytes(b"//" + there + b"/v1/chat/completions"),
                request_bytes(b"/v1/chat/completions", host=there, extra=(
                    b"X-Forwarded-Host: " + there + b"\r\nForwarded: host=" + there + b"\r\n"
                    b"X-Original-URL: " + trap_url.encode() + b"/v1/chat/completions\r\n"
                    b"X-Rewrite-URL: " + trap_url.encode() + b"\r\n")),
                request_bytes(b"/v1/chat/completions?url=" + trap_url.encode()),
                request_bytes(b"/v1/chat/completions", body=json.dumps(
                    {**valid_body("/v1/chat/completions"), "url": trap_url,
                     "base_url": trap_url}).encode()),
                request_bytes(b"/v1/chat/completions/../../" + there + b"/v1/chat/completions"),
                request_bytes(b"@" + there + b"/v1/chat/completions"),
                request_bytes(b"/v1/chat%2Fcompletions", host=there),
                b"CONNECT " + there + b" HTTP/1.1\r\nHost: " + there + b"\r\n\r\n",
                request_bytes(b"/v1/chat/completions", extra=b"Upgrade: h2c\r\nHTTP2-Settings: AAA\r\n"),
            ]
            statuses = []
            for data in attempts:
                raw = await raw_exchange(port, data)
                status = status_of(raw)
                statuses.append(status)
                assert status is not None and status < 500, raw[:300]
                if status == 200:  # served, by one of the configured backends
                    assert re.search(rb"x-gateway-backend: (mtp|plain)", raw), raw[:300]
                    assert b'"chat.completion"' in raw
            assert statuses.count(200) >= 4 and any(s and s >= 400 for s in statuses), statuses
        assert trap.received == [], "the gateway called an address the client chose"


GARBAGE = [
    b"\x00\x01\x02\xff\xfe\r\n\r\n",
    bytes.fromhex("16030100a5010000a10303") + b"\x00" * 64,  # a TLS ClientHello
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    b"POST /v1/chat/completions HTTP/1.1\r\nHost x\r\n\r\n",  # header without colon
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
    b"POST /v1/chat/ completions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    # request smuggling: both framings
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /admin/state HTTP/1.1\r\n"
    b"Host: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n",
    b"FOO /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
]


@pytest.mark.timeout(40)
async def test_malformed_http_is_refused_never_5xx_never_a_hang(sim) -> None:
    settings = gateway_settings(sim, auth={"admin_key": "admin-key"},
                                timeouts={"first_byte_s": 2.0})
    app = create_app(settings, registry=CollectorRegistry())
    runtime = app.state.runtime
    async with serve_like_cli(app, settings) as port:
        for data in GARBAGE:
            try:
                raw = await raw_exchange(port, data, timeout=8.0)
            except TimeoutError:
                pytest.fail(f"no answer and no close for {data[:60]!r}")
            status = status_of(raw)
            assert raw == b"" or (status is not None and 400 <= status < 500), (data[:60], raw[:200])
            if status == 400:  # what the HTTP parser refuses is OpenAI-shaped too
                assert set(json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]) == ERROR_KEYS, raw
            assert b"admin" not in raw.split(b"\r\n\r\n", 1)[-1]  # the smuggled request never ran
        await wait_until(lambda: runtime.pool.concurrency == 0, timeout=5)
        async with httpx.AsyncClient() as client:
            response = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat())
        assert response.status_code == 200


@pytest.mark.timeout(30)
async def test_an_oversized_request_head_is_refused_with_431_before_it_is_buffered(sim) -> None:
    limit = 16384
    settings = gateway_settings(sim, limits={"max_header_bytes": limit})
    app = create_app(settings, registry=CollectorRegistry())
    async with serve_like_cli(app, settings) as port:
        # A whole head over the limit: 431, OpenAI-shaped, and the connection closes.
        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * limit + b"\r\n\r\n"
        answer = await raw_exchange(port, head)
        assert status_of(answer) == 431, answer[:200]
        assert set(json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]) == ERROR_KEYS

        # A header that never ends: refused once the limit is passed, not buffered for ever.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, answer = 0, b""
        try:
            for _ in range(2000):  # up to 128 MiB, were nothing to stop it
                writer.write(b"a" * 65536)
                await asyncio.wait_for(writer.drain(), 5)
                sent += 65536
            answer = await asyncio.wait_for(reader.read(), 5)
        except ConnectionError:
            pass  # reset: the gateway closed while we were still sending
        finally:
            writer.close()
        assert sent < 4 * 1024 * 1024, f"{sent} bytes of one header accepted"
        assert answer == b"" or status_of(answer) == 431

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            # Big but within the limit: served. Many small headers add up like one big one.
            fine = await client.post("/v1/chat/completions", json=chat(max_tokens=1),
                                     headers={"x-big": "b" * (limit - 1000)})
            assert fine.status_code == 200
            many = [(f"x-h{i}", "v" * 100) for i in range(limit // 100)]
            assert (await client.get("/health", headers=many)).status_code == 431


@pytest.mark.timeout(30)
def test_connections_the_client_resets_leave_nothing_behind() -> None:
    """A connection the client resets kept uvicorn's keep-alive timer, and with it the
    protocol, scope and buffers, for timeout_keep_alive (75 s): ~5 KB per abandoned connection,
    150 MB at 400 aborts/s. Run under uvloop, what `serve` uses."""
    uvloop = pytest.importorskip("uvloop")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    def dead_but_kept() -> int:  # protocols of connections already closed
        gc.collect()
        return sum(isinstance(o, HttpToolsProtocol) and o.transport.is_closing()
                   for o in gc.get_objects())

    async def scenario() -> None:
        fake = FakeBackend()
        async with serve_app(fake.app) as url:
            settings = gateway_settings(None, backends={"mtp": {"url": url}, "plain": {"url": url}})
            app = create_app(settings, registry=CollectorRegistry())
            async with serve_like_cli(app, settings) as port:
                await app.state.runtime.probes.probe_all()
                for stream in [False, True] * 25:
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    body = json.dumps({**valid_body("/v1/chat/completions"), "stream": stream})
                    writer.write(request_bytes(b"/v1/chat/completions", body=body.encode())
                                 .replace(b"Connection: close\r\n", b""))
                    await reader.readuntil(b"[DONE]" if stream else b'"finish_reason"')
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.close()  # RST, not FIN
                await wait_until(lambda: dead_but_kept() == 0, timeout=5, interval=0.1)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


@pytest.mark.timeout(30)
async def test_a_request_body_that_never_finishes_is_dropped_after_idle_s(sim) -> None:
    """A client that sends its headers, then part of the body, then nothing (slowloris) must
    not hold a connection and a task for ever: silence while the body is read ends it after
    `timeouts.idle_s` with 408, OpenAI-shaped."""
    settings = gateway_settings(sim, timeouts={"idle_s": 0.5})
    app = create_app(settings, registry=CollectorRegistry())
    async with serve_like_cli(app, settings) as port:
        partial = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                   b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        started = asyncio.get_running_loop().time()
        try:
            answer = await raw_exchange(port, partial, timeout=5.0)
        except TimeoutError:
            pytest.fail("the half-sent request was still held open after 5 s")
        took = asyncio.get_running_loop().time() - started
        assert status_of(answer) == 408, answer[:200]
        assert set(json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]) == ERROR_KEYS
        assert took < 0.5 + 1.0


# --- credentials and hop-by-hop headers ---------------------------------------------------------

HOP_AND_CREDENTIALS = {
    "authorization": "Bearer client-secret", "x-api-key": "client-secret",
    "proxy-authorization": "Basic cHJveHk6c2VjcmV0", "cookie": "session=client-secret",
    "te": "trailers", "trailer": "x-checksum", "keep-alive": "timeout=5", "upgrade": "h2c",
    "proxy-connection": "keep-alive", "x-gateway-pin": "mtp",
    "connection": "keep-alive, x-hop-secret", "x-hop-secret": "hop-only",
}


@pytest.mark.timeout(30)
async def test_hop_by_hop_and_client_credentials_never_reach_the_backend() -> None:
    fake = FakeBackend()
    async with serve_app(fake.app) as url:
        backends = {name: {"url": url, "api_key": "backend-secret"} for name in ("mtp", "plain")}
        auth = {"api_keys": ["client-secret"]}
        async with live_gateway(None, backends=backends, auth=auth) as gateway, \
                httpx.AsyncClient() as client:
            await gateway.runtime.probes.probe_all()
            for stream in (False, True):
                headers = {**HOP_AND_CREDENTIALS, "x-request-id": "req-1", "user-agent": "agent/1",
                           "x-session-id": "s-1"}
                response = await client.post(gateway.url + "/v1/chat/completions",
                                             json=chat(max_tokens=2, stream=stream), headers=headers)
                assert response.status_code == 200, response.text
                path, received, _ = fake.received[-1]
                names = {name for name, _ in received}
                leaked = names & (set(HOP_AND_CREDENTIALS) - {"authorization"})
                assert not leaked, f"forwarded to the backend: {leaked}"
                assert dict(received)["authorization"] == "Bearer backend-secret"
                assert "client-secret" not in str(received)
                assert {"x-request-id", "user-agent", "x-session-id"} <= names  # the rest passes


@pytest.mark.timeout(30)
async def test_backend_credentials_and_cookies_never_reach_the_client() -> None:
    fake = FakeBackend()
    fake.response_headers = {"set-cookie": "backend=backend-secret", "x-backend-note": "fine",
                             "www-authenticate": "Bearer realm=backend-secret",
                             "proxy-authenticate": "Basic realm=backend-secret"}
    async with serve_app(fake.app) as url:
        backends = {name: {"url": url, "api_key": "backend-secret"} for name in ("mtp", "plain")}
        async with live_gateway(None, backends=backends, auth={"admin_key": "admin-key"}) as gateway, \
                httpx.AsyncClient(base_url=gateway.url) as client:
            await gateway.runtime.probes.probe_all()
            answers = [await client.post("/v1/chat/completions", json=chat(stream=stream))
                       for stream in (False, True)]
            assert all(a.headers["x-backend-note"] == "fine" for a in answers)
            answers += [await client.get(path) for path in ("/health", "/v1/models", "/metrics",
                                                            "/dashboard/state")]
            answers.append(await client.get("/admin/state",
                                            headers={"authorization": "Bearer admin-key"}))
            for answer in answers:
                assert answer.status_code == 200, answer.request.url
                assert "backend-secret" not in str(answer.headers.raw) + answer.text, answer.request.url


@pytest.mark.timeout(30)
async def test_response_headers_named_in_connection_stay_with_the_backend() -> None:
    """RFC 9110 7.6.1, the response side: what the backend's Connection header names
    describes the backend-to-gateway hop only."""
    fake = FakeBackend()
    fake.response_headers = {"connection": "x-backend-hop", "x-backend-hop": "hop-only",
                             "keep-alive": "timeout=5", "x-backend-note": "fine"}
    async with serve_app(fake.app) as url:
        backends = {name: {"url": url} for name in ("mtp", "plain")}
        async with live_gateway(None, backends=backends) as gateway, \
                httpx.AsyncClient(base_url=gateway.url) as client:
            await gateway.runtime.probes.probe_all()
            for stream in (False, True):
                answer = await client.post("/v1/chat/completions", json=chat(stream=stream))
                assert answer.status_code == 200 and answer.headers["x-backend-note"] == "fine"
                assert "keep-alive" not in answer.headers
                assert "x-backend-hop" not in answer.headers, answer.headers


SECRETS = ("client-secret-AAA", "admin-secret-BBB", "backend-secret-CCC", "wrong-secret-DDD")


@pytest.mark.timeout(30)
async def test_keys_never_appear_in_logs(caplog: pytest.LogCaptureFixture,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    """Auth failures, backend 5xx, a crash mid-stream, a refused backend, an aborted stream:
    none of it logs a client key, the admin key, the backend key or a wrong key tried."""
    caplog.set_level(logging.DEBUG)
    async with start_sim_pair(SimOptions(speed=50, api_key="backend-secret-CCC")) as pair:
        backends = {n: {"url": u, "api_key": "backend-secret-CCC"} for n, u in pair.urls.items()}
        auth = {"api_keys": ["client-secret-AAA"], "admin_key": "admin-secret-BBB",
                "metrics_public": False}
        async with live_gateway(pair, backends=backends, auth=auth,
                                monitor={"fall": 1, "interval_s": 0.02}) as gateway, \
                httpx.AsyncClient(base_url=gateway.url) as client:
            url, good = "/v1/chat/completions", {"authorization": "Bearer client-secret-AAA"}
            for headers in ({"authorization": "Bearer wrong-secret-DDD"},
                            {"x-api-key": "wrong-secret-DDD"}, {}):
                assert (await client.post(url, json=chat(), headers=headers)).status_code == 401
            for path in ("/admin/state", "/metrics"):
                wrong = {"authorization": "Bearer wrong-secret-DDD"}
                assert (await client.get(path, headers=wrong)).status_code == 401
            assert (await client.get("/metrics", headers=good)).status_code == 401

            mtp = pair.servers["mtp"]
            await mtp.set_faults(Faults(fail_status=500, fail_count=1))  # 5xx then retried
            assert (await client.post(url, json=chat(), headers=good)).status_code == 200
            await mtp.set_faults(Faults(crash_after_chunks=2))  # broken mid-stream:
            broken = await client.post(url, json=chat(stream=True), headers=good)
            # continued on plain (its /v1/tokenize and chat asked with the backend key)
            assert b'"finish_reason":"' in broken.content and b'"error"' not in broken.content
            await mtp.clear_faults()
            long = chat(max_tokens=100000, ignore_eos=True, stream=True)
            async with client.stream("POST", url, headers=good, json=long) as response:
                await response.aiter_raw().__anext__()
            # ... left mid-stream: the gateway posts /abort_request with the backend key
            await mtp.set_faults(Faults(refuse_connections=True))  # down: probes fail, logged
            await wait_until(lambda: not gateway.pool.backends["mtp"].up, timeout=5)
            assert (await client.post(url, json=chat(), headers=good)).status_code == 200
            await mtp.clear_faults()
            await wait_until(lambda: gateway.pool.backends["mtp"].up, timeout=5)
            await wait_until(lambda: not gateway.runtime.proxy.aborts.background, timeout=5)
    formatter = logging.Formatter()
    logged = "\n".join(record.getMessage() + (formatter.formatException(record.exc_info)
                                              if record.exc_info else "")
                       for record in caplog.records)
    captured = capfd.readouterr()
    logged += captured.out + captured.err
    assert "circuit" in logged or "down" in logged or "retrying" in logged  # logging did happen
    assert "backend mtp is down" in logged  # the probe failure itself was logged
    for secret in SECRETS:
        assert secret not in logged, f"{secret} was logged"


@pytest.mark.timeout(30)
async def test_metrics_and_dashboard_need_the_admin_key_unless_public(sim) -> None:
    closed = {"metrics_public": False, "api_keys": ["client-key"]}
    async with live_gateway(sim, auth=closed) as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        for path in ("/metrics", "/dashboard", "/dashboard/state", "/admin/state"):
            response = await client.get(path)
            assert response.status_code == 403, path  # no admin key configured: closed for all
            assert_openai_error(response)
    async with live_gateway(sim, auth={**closed, "admin_key": "admin-key"}) as gateway, \
            httpx.AsyncClient(base_url=gateway.url) as client:
        for path in ("/metrics", "/dashboard", "/dashboard/state", "/admin/state"):
            for headers in ({}, {"authorization": "Bearer client-key"},
                            {"authorization": "Bearer admin-keyx"}, {"x-api-key": "admin-ke"}):
                response = await client.get(path, headers=headers)
                assert response.status_code == 401, (path, headers)
                assert assert_openai_error(response)["type"] == "authentication_error"
            for headers in ({"authorization": "Bearer admin-key"}, {"x-api-key": "admin-key"}):
                assert (await client.get(path, headers=headers)).status_code == 200, path
        health = await client.get("/health")  # liveness stays open, and tells no URL
        assert health.status_code == 200 and "127.0.0.1" not in health.text
