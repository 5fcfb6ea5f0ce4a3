"""A scripted SGLang stand-in on a real socket, one per backend, for the gateway's own tests.

It answers every path the gateway forwards with SGLang-shaped bytes (or with pieces the test
scripts), records what it received (path, headers, body), and can drop the connection after
its pieces or hold the stream open until the client leaves. The simulator is the faithful
model; this one shows what the gateway sends and lets a test choose the exact bytes back."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "Qwen/Qwen3.5-122B-A10B"
_as_bool = TypeAdapter(bool).validate_python  # `stream` as SGLang's pydantic models read it
QUEUE_FULL = "The request queue is full."


def sse(name: str | None, data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data)
    head = b"event: %s\n" % name.encode() if name else b""
    return head + b"data: %s\n\n" % payload.encode()


def chat_events(text: str = "Hello there", model: str = MODEL) -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse(None, {"id": "c1", "object": "chat.completion.chunk", "model": model,
                          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    words = [chunk({"content": word}) for word in text.split(" ")]
    usage = sse(None, {"id": "c1", "object": "chat.completion.chunk", "model": model, "choices": [],
                       "usage": {"prompt_tokens": 7, "completion_tokens": len(words),
                                 "total_tokens": 7 + len(words)}})
    return [chunk({"role": "assistant", "content": ""}), *words, chunk({}, "stop"), usage,
            b"data: [DONE]\n\n"]


def chat_refusal(status: int = 503, message: str = QUEUE_FULL) -> list[bytes]:
    """SGLang's full queue on a streaming chat: HTTP 200, the error first, usage, [DONE]
    (serving_chat.py:2565-2576, 2766-2797)."""
    error = {"error": {"object": "error", "message": message, "type": "SERVICE_UNAVAILABLE",
                       "param": None, "code": status}}
    usage = {"id": "c1", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
             "usage": {"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}}
    return [sse(None, error), sse(None, usage), b"data: [DONE]\n\n"]


def anthropic_events(text: str = "Hello there", model: str = MODEL) -> list[bytes]:
    start = {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": model,
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 7, "output_tokens": 0}}}
    deltas = [sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                          "delta": {"type": "text_delta", "text": word + " "}})
              for word in text.split(" ")]
    return [sse("message_start", start),
            sse("content_block_start", {"type": "content_block_start", "index": 0,
                                        "content_block": {"type": "text", "text": ""}}),
            *deltas,
            sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                  "usage": {"output_tokens": len(deltas)}}),
            sse("message_stop", {"type": "message_stop"})]


def anthropic_refusal(message: str = QUEUE_FULL) -> list[bytes]:
    """What SGLang's /v1/messages makes of the same refusal (anthropic/serving.py:978-993)."""
    events = anthropic_events()
    return [events[0], sse("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": message}}),
            sse("message_stop", {"type": "message_stop"})]


def _response(response_id: str, status: str, output: list[Any], model: str = MODEL,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "created_at": 1, "model": model,
            "status": status, "output": output, "error": error, "incomplete_details": None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": None if status != "completed" else {
                "input_tokens": 7, "output_tokens": 2, "total_tokens": 9,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0}}}


def responses_events(response_id: str, text: str = "Hello there") -> list[bytes]:
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    done_item = {**item, "status": "completed",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]}
    events = [
        ("response.created", {"response": _response(response_id, "in_progress", [])}),
        ("response.in_progress", {"response": _response(response_id, "in_progress", [])}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {"item_id": "msg_1", "output_index": 0,
                                         "content_index": 0, "part": part}),
        *[("response.output_text.delta", {"item_id": "msg_1", "output_index": 0,
                                          "content_index": 0, "delta": word, "logprobs": []})
          for word in _words(text)],
        ("response.output_text.done", {"item_id": "msg_1", "output_index": 0, "content_index": 0,
                                       "text": text, "logprobs": []}),
        ("response.content_part.done", {"item_id": "msg_1", "output_index": 0,
                                        "content_index": 0, "part": {**part, "text": text}}),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        ("response.completed", {"response": _response(response_id, "completed", [done_item])}),
    ]
    return [sse(name, {"type": name, "sequence_number": i, **data})
            for i, (name, data) in enumerate(events)]


def responses_refusal(response_id: str, message: str = QUEUE_FULL) -> list[bytes]:
    """SGLang's /v1/responses on the same refusal: created, in_progress, then response.failed
    (serving_responses.py:3018-3057)."""
    failed = _response(response_id, "failed", [], error={"code": "server_error", "message": message})
    return [*responses_events(response_id)[:2],
            sse("response.failed", {"type": "response.failed", "sequence_number": 2,
                                    "response": failed})]


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [word + (" " if i < len(words) - 1 else "") for i, word in enumerate(words)]


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class ScriptedBackend:
    name: str
    models: list[str] = field(default_factory=lambda: [MODEL])
    received: list[Received] = field(default_factory=list)
    script: list[bytes] | None = None  # pieces of every stream, instead of the default
    die: bool = False  # after the pieces, drop the connection
    hold: bool = False  # after the pieces, keep the stream open until the client leaves
    admin_key: str | None = None  # /abort_request requires it, like SGLang's --admin-api-key
    stored: set[str] = field(default_factory=set)  # response ids it stored
    streams_open: int = 0

    def __post_init__(self) -> None:
        post = ["POST"]
        self.app = Starlette(routes=[
            Route("/v1/loads", self._loads), Route("/server_info", self._server_info),
            Route("/get_server_info", self._server_info),
            Route("/v1/models", self._models), Route("/v1/models/{model:path}", self._model),
            Route("/abort_request", self._abort, methods=post),
            Route("/v1/responses/{rid}", self._stored),
            Route("/v1/responses/{rid}/cancel", self._stored, methods=post),
            *[Route(path, self._answer, methods=post) for path in (
                "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                "/generate")],
        ])

    def requests_to(self, path: str) -> list[Received]:
        return [r for r in self.received if r.path == path]

    @property
    def aborted(self) -> list[str]:
        return [r.json["rid"] for r in self.requests_to("/abort_request")]

    async def _record(self, request: Request) -> Received:
        received = Received(request.url.path, dict(request.headers), await request.body())
        self.received.append(received)
        return received

    async def _loads(self, request: Request) -> Response:
        return JSONResponse({"loads": [{"num_running_reqs": self.streams_open,
                                        "num_waiting_reqs": 0}]})

    async def _server_info(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"served_by": self.name, "max_running_requests": 48,
                             "internal_states": [{"avg_spec_accept_length": 1.8}]})

    async def _models(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "owned_by": "sglang"} for model in self.models]})

    async def _model(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model not in self.models:
            return JSONResponse({"error": {"message": f"The model '{model}' does not exist",
                                           "type": "invalid_request_error", "param": "model",
                                           "code": "model_not_found"}}, 404)
        return JSONResponse({"id": model, "object": "model", "owned_by": "sglang"})

    async def _abort(self, request: Request) -> Response:
        await self._record(request)
        if self.admin_key and request.headers.get("authorization") != f"Bearer {self.admin_key}":
            return JSONResponse({"error": "Unauthorized"}, 401)
        return Response(status_code=200)

    async def _stored(self, request: Request) -> Response:
        await self._record(request)
        rid = request.path_params["rid"]
        if rid not in self.stored:
            return JSONResponse({"error": {"message": f"Response with id '{rid}' not found.",
                                           "type": "invalid_request_error", "param": None,
                                           "code": 404}}, 404)
        status = "cancelled" if request.url.path.endswith("/cancel") else "completed"
        return JSONResponse(_response(rid, status, []))

    async def _answer(self, request: Request) -> Response:
        received = await self._record(request)
        body = received.json
        path = received.path
        if path == "/v1/responses" and body.get("store", True):
            self.stored.add(body["request_id"])
        if body.get("stream") is not None and _as_bool(body["stream"]):
            pieces = self.script if self.script is not None else self._default_stream(path, body)
            return StreamingResponse(self._pieces(pieces), media_type="text/event-stream")
        return JSONResponse(self._default_answer(path, body))

    def _default_stream(self, path: str, body: dict[str, Any]) -> list[bytes]:
        if path == "/v1/messages":
            return anthropic_events(model=body.get("model", MODEL))
        if path == "/v1/responses":
            return responses_events(body["request_id"])
        if path == "/generate":
            return [sse(None, {"text": "Hello", "meta_info": {"id": body.get("rid"),
                                                              "finish_reason": None}}),
                    sse(None, {"text": "Hello there", "meta_info": {
                        "id": body.get("rid"), "finish_reason": {"type": "stop"}}}),
                    b"data: [DONE]\n\n"]
        return chat_events(model=body.get("model", MODEL))

    def _default_answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model", MODEL)
        if path == "/v1/messages":
            return {"id": "msg_1", "type": "message", "role": "assistant", "model": model,
                    "content": [{"type": "text", "text": "Hello there"}],
                    "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 7, "output_tokens": 2}}
        if path == "/v1/responses":
            return _response(body["request_id"], "completed", [{
                "id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "Hello there", "annotations": []}]}])
        if path == "/generate":
            return {"text": "Hello there", "meta_info": {"id": body.get("rid"),
                                                         "finish_reason": {"type": "stop"}}}
        return {"id": "c1", "object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hello there"},
             "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}}

    async def _pieces(self, pieces: list[bytes]) -> Any:
        self.streams_open += 1
        try:
            for piece in pieces:
                yield piece
                await asyncio.sleep(0.002)  # its own write, and mostly its own read upstream
            if self.die:
                raise ConnectionAbortedError("the backend process died")  # uvicorn drops it
            if self.hold:
                await asyncio.Event().wait()  # until the gateway closes the connection
        finally:
            self.streams_open -= 1
