"""The memory-saver calls as the gateway sends them (gateway/upstream/engine/sglang.py MemorySaver):
SGLang 0.5.23's paths and bodies, the admin key of an ADMIN_OPTIONAL endpoint
(utils/auth.py:133-147), and its answers judged as SGLang gives them."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.config import Backend
from gateway.upstream.client import Upstream
from gateway.upstream.engine.sglang import CallFailed, MemorySaver
from tests.live import serve_app

SEEN: list[tuple[str, bytes, str | None]] = []
ANSWER: dict[str, Response] = {}


async def record(request: Request) -> Response:
    SEEN.append((request.url.path, await request.body(), request.headers.get("authorization")))
    return ANSWER.get(request.url.path) or Response(b"null", media_type="application/json")


APP = Starlette(routes=[Route(p, record, methods=["POST"]) for p in (
    "/pause_generation", "/release_memory_occupation", "/resume_memory_occupation",
    "/continue_generation")])


@pytest.mark.parametrize("keys,sent", [
    ({"api_key": "user", "admin_api_key": "admin"}, "Bearer admin"),
    ({"api_key": "user"}, "Bearer user"),
    ({}, None),
])
@pytest.mark.timeout(20)
async def test_the_four_calls_with_sglangs_bodies_and_the_admin_key(keys, sent):
    SEEN.clear()
    ANSWER.clear()
    async with serve_app(APP) as url:
        upstream = Upstream(connect_timeout_s=2)
        await upstream.start()
        try:
            saver = MemorySaver(upstream, Backend(url=url, **keys), "mtp")
            await saver.pause(2)
            await saver.release(2)
            await saver.resume(2)
            await saver.continue_generation(2)
        finally:
            await upstream.close()
    assert SEEN == [("/pause_generation", b'{"mode":"retract"}', sent),
                    ("/release_memory_occupation", b'{"tags":null}', sent),
                    ("/resume_memory_occupation", b'{"tags":null}', sent),
                    ("/continue_generation", b"{}", sent)]


@pytest.mark.parametrize("answer,detail", [
    (JSONResponse({"error": {"message": "boom"}}, 400), "answered 400: boom"),
    (JSONResponse({"ok": True}), "answered 200 with"),  # not SGLang's null: not trusted
])
@pytest.mark.timeout(20)
async def test_a_release_answered_otherwise_than_null_is_an_error(answer, detail):
    ANSWER.clear()
    ANSWER["/release_memory_occupation"] = answer
    async with serve_app(APP) as url:
        upstream = Upstream(connect_timeout_s=2)
        await upstream.start()
        try:
            with pytest.raises(CallFailed) as failed:
                await MemorySaver(upstream, Backend(url=url), "mtp").release(2)
        finally:
            await upstream.close()
    assert failed.value.kind == "error" and detail in failed.value.detail


@pytest.mark.timeout(20)
async def test_a_refused_connection_is_gone_and_never_sent():
    upstream = Upstream(connect_timeout_s=2)
    await upstream.start()
    try:
        with pytest.raises(CallFailed) as failed:
            await MemorySaver(upstream, Backend(url="http://127.0.0.1:9"), "mtp").release(2)
    finally:
        await upstream.close()
    assert failed.value.kind == "gone" and failed.value.sent is False
