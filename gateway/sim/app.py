"""The HTTP app of one simulated SGLang 0.5.23 server (Starlette).

Routes, JSON shapes, SSE bytes, error envelopes and disconnect behaviour follow
``research/sglang.md`` sections 2-5; the engine behind it is a :class:`LiveEngine`. Extra,
sim-only routes: ``POST``/``DELETE /sim/faults`` and ``GET /sim/state`` (see faults.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.sim import formats
from gateway.sim.engine import Output, QueueFullError
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.faults import Faults, FaultState
from gateway.sim.live import LiveEngine
from gateway.sim.metrics import SimMetrics
from gateway.sim.requests import (
    RequestError,
    anthropic_chosen_tool,
    anthropic_thinking,
    anthropic_tools,
    choices_of,
    chosen_tool,
    max_tokens_of,
    read_json,
    responses_chosen_tool,
    stream_flag,
)
from gateway.sim.requests import last_is_user as _last_is_user
from gateway.sim.responses_store import STORE_DISABLED, ResponsesStore
from gateway.sim.text import (
    chat_prompt_text,
    content_text,
    plan_output,
    responses_prompt_text,
    thinking_requested,
    token_ids,
)

VERSION = "0.5.23"
HEALTH_MIN_S = 1.0  # SGLang's /health generates one token and polls in 1 s sleeps
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
REQUEST_STATE_WAIT_TIMEOUT_S = 4.0  # environ.py:1679, how often a waiting handler wakes
FORCE_STREAM_INTERVAL = 50  # environ.py:688, a non-stream request's output every 50 tokens
OPEN_PATHS = ("/health", "/ready", "/metrics")  # never need the API key, as in SGLang
ADMIN_OPTIONAL_PATHS = frozenset({"/abort_request"})  # of the routes the simulator has
T = TypeVar("T")


class SimulatedCrash(Exception):
    """Raised inside a response so uvicorn drops the connection mid-way (crash fault)."""


def json_response(body: Any, status: int = 200) -> Response:
    # Compact, as SGLang's ORJSONResponse writes it.
    return Response(formats.compact(body), status, media_type="application/json")


def openai_error(status: int, message: str, err_type: str) -> Response:
    return json_response(formats.openai_error_body(status, message, err_type), status)


# How each API answers a request refused before any output (validation, a sim fault) ...


def _openai_refusal(exc: RequestError) -> Response:
    """serving_base.py:205, flat."""
    return openai_error(exc.status, str(exc), exc.err_type)


def _anthropic_refusal(exc: RequestError) -> Response:
    """anthropic/serving.py:1409: ``{"type": "error", "error": {type, message}}``."""
    return json_response(formats.anthropic_error_body(exc.status, str(exc)), exc.status)


def _responses_refusal(exc: RequestError) -> Response:
    """serving_responses.py:246, nested under "error"."""
    err_type = "invalid_request_error" if exc.err_type == "BadRequestError" else exc.err_type
    return json_response(formats.responses_error_body(exc.status, str(exc), err_type, exc.param), exc.status)


# ... and a non-stream request the scheduler aborted with an HTTP status (a full queue: 503).
# tokenizer_manager.py:1917 raises ValueError for a 400, HTTPException otherwise.


def _openai_aborted(status: int, message: str) -> Response:
    """serving_base.py:117: HTTPException -> type str(status)."""
    return openai_error(status, message, "BadRequestError" if status == 400 else str(status))


def _anthropic_aborted(status: int, message: str) -> Response:
    """anthropic/serving.py:780: a 5xx message is scrubbed to "Internal server error". A 400
    (a ValueError) is caught by the chat handler first and comes back as its flat error, whose
    4xx type the converter keeps (anthropic/serving.py:1393): "BadRequestError"."""
    if status == 400:
        body = {"type": "error", "error": {"type": "BadRequestError", "message": message}}
        return json_response(body, 400)
    return _anthropic_refusal(RequestError("Internal server error" if status >= 500 else message, status))


def _responses_aborted(status: int, message: str) -> Response:
    """serving_responses.py:730: the HTTPException is caught as any exception and becomes a 400
    whose message is str(exc), "503: The request queue is full."."""
    text = message if status == 400 else f"{status}: {message}"
    return _responses_refusal(RequestError(text, err_type="invalid_request_error"))


NOT_AN_EMBEDDING_MODEL = ("This model does not appear to be an embedding model by default. Please add "
                          "`--is-embedding` when launching the server or try another model.")  # fmt: skip


class Vocabulary:
    """Word <-> token id of /tokenize and /detokenize, ids given in order of first sight."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words[i] if 0 <= i < len(self._words) else "" for i in ids)


def _generate_refusal(exc: RequestError) -> Response:
    """http_server.py:2246 (_create_error_response): ``{"error": {"message"}}``."""
    return json_response({"error": {"message": str(exc)}}, exc.status)


def _generate_aborted(status: int, message: str) -> Response:
    """A 400 is the ValueError above; another status is FastAPI's HTTPException handler,
    flat (http_server.py:624)."""
    if status == 400:
        return _generate_refusal(RequestError(message))
    return openai_error(status, message, str(status))


@dataclass(frozen=True)
class Api:
    """One generation endpoint: how it parses a request, renders it, and answers failures."""

    parse: Callable[[dict[str, Any]], formats.Job]
    renderer: Callable[[formats.Job], formats.Renderer]
    body: Callable[[formats.Job, int, str], dict[str, Any]]
    refuse: Callable[[RequestError], Response]
    aborted: Callable[[int, str], Response]
    kick_started: bool = False  # a raise before the first chunk is an HTTP error (chat, completions)
    stream_optional: bool = True  # `stream: Optional[bool]` (null allowed)
    header_overrides: bool = False  # reads x-override-rid when SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES


@dataclass(frozen=True)
class Failure:
    """A request that ends before its first token: a status abort, or a raise (a 400)."""

    status: int
    message: str
    raised: bool = False


async def replay(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


@dataclass
class ServerIdentity:
    """What the server says about itself in /server_info (the port is known after binding)."""

    name: str  # "mtp" or "plain"
    host: str
    port: int
    seed: int


class ApiKeyMiddleware:
    """``--api-key`` and ``--admin-api-key`` (utils/auth.py:decide_request_auth): health,
    readiness and metrics are open; /abort_request (AuthLevel.ADMIN_OPTIONAL,
    http_server.py:1722) takes the admin key when one is set, else the API key, else nothing;
    every other route the API key when set. A refusal is 401 ``{"error": "Unauthorized"}``
    (pure ASGI, so client disconnects still reach the app)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._admin_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PATHS):
            return True
        key = self._key
        if scope["path"] in ADMIN_OPTIONAL_PATHS and self._admin_key is not None:
            key = self._admin_key
        if key is None:
            return True
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, key)


class CrashResponse(Response):
    """Sends the headers, then drops the connection (a crash before the body)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Promise a body that never comes, so the client sees a truncated response.
        headers = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        raise SimulatedCrash


class SimApp:
    """Handlers of one simulated server; ``build()`` makes the ASGI app."""

    def __init__(self, identity: ServerIdentity, live: LiveEngine, faults: FaultState,
                 enable_response_store: bool = False, header_overrides: bool = False) -> None:  # fmt: skip
        self.identity = identity
        self.live = live
        self.faults = faults
        self.profile = live.engine.profile
        self.metrics = SimMetrics(live.engine, live.speed)
        self.started = time.time()
        self.apis = self._apis()
        self._watchers: set[asyncio.Task[None]] = set()
        self.responses_store = ResponsesStore(enable_response_store)
        self.header_overrides = header_overrides
        self.vocabulary = Vocabulary()

    def build(self, api_key: str | None = None, admin_api_key: str | None = None) -> ASGIApp:
        app = Starlette(routes=self._routes())
        return ApiKeyMiddleware(app, api_key, admin_api_key) if api_key or admin_api_key else app

    def _routes(self) -> list[Route]:
        get, post = ["GET"], ["POST"]
        return [
            Route("/v1/chat/completions", self.chat, methods=post),
            Route("/v1/completions", self.completions, methods=post),
            Route("/v1/messages", self.messages, methods=post),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=post),
            Route("/v1/responses", self.responses, methods=post),
            Route("/v1/responses/{response_id}", self.get_response, methods=get),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=post),
            Route("/generate", self.generate, methods=["POST", "PUT"]),
            Route("/v1/embeddings", self.not_an_embedding_model, methods=post),
            Route("/v1/classify", self.not_an_embedding_model, methods=post),
            Route("/v1/tokenize", self.tokenize, methods=post),
            Route("/tokenize", self.tokenize, methods=post),
            Route("/v1/detokenize", self.detokenize, methods=post),
            Route("/detokenize", self.detokenize, methods=post),
            Route("/v1/models", self.models, methods=get),
            Route("/v1/models/{model:path}", self.model_card, methods=get),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/server_info", self.server_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/v1/loads", self.loads, methods=get),
            Route("/health", self.health, methods=get),
            Route("/health_generate", self.health, methods=get),
            Route("/ready", self.ready, methods=get),
            Route("/abort_request", self.abort_request, methods=post),
            Route("/metrics", self.prometheus, methods=get),
            Route("/sim/faults", self.set_faults, methods=post),
            Route("/sim/faults", self.clear_faults, methods=["DELETE"]),
            Route("/sim/state", self.state, methods=get),
        ]

    # --- generation endpoints ------------------------------------------------------------

    def _apis(self) -> dict[str, Api]:
        chat_aborted = _openai_aborted
        return {
            "chat": Api(self._parse_chat, formats.ChatRenderer, formats.chat_body, _openai_refusal,
                        chat_aborted, kick_started=True, stream_optional=False, header_overrides=True),
            "completions": Api(self._parse_completion, formats.CompletionRenderer, formats.completion_body,
                               _openai_refusal, chat_aborted, kick_started=True, stream_optional=False),
            "messages": Api(self._parse_messages, formats.MessagesRenderer, formats.anthropic_message,
                            _anthropic_refusal, _anthropic_aborted, header_overrides=True),
            "responses": Api(self._parse_responses, formats.ResponsesRenderer,
                             formats.responses_final_body, _responses_refusal, _responses_aborted),
            "generate": Api(self._parse_generate, self._generate_renderer, formats.generate_body,
                            _generate_refusal, _generate_aborted, stream_optional=False,
                            header_overrides=True),
        }  # fmt: skip

    def _generate_renderer(self, job: formats.Job) -> formats.Renderer:
        draft_tokens = self.profile.num_draft_tokens if self.profile.speculative else 0
        return formats.GenerateRenderer(job, draft_tokens)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, self.apis["chat"])

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self.apis["completions"])

    async def messages(self, request: Request) -> Response:
        return await self._serve(request, self.apis["messages"])

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, self.apis["responses"])

    async def generate(self, request: Request) -> Response:
        return await self._serve(request, self.apis["generate"])

    async def _serve(self, request: Request, api: Api) -> Response:
        try:
            body = await read_json(request, require_json_type=api is not self.apis["generate"])
            stream = stream_flag(body, api.stream_optional)
            job = api.parse(body)
        except RequestError as exc:
            return api.refuse(exc)
        rid = request.headers.get("x-override-rid")
        if rid is not None and self.header_overrides and api.header_overrides:
            job = dataclasses.replace(job, rid=rid)  # request_headers.py, behind an env var
        return await self._generate(request, job, stream, api)

    # --- parsing -------------------------------------------------------------------------

    def _job(
        self, body: dict[str, Any], text: str, prompt_ids: list[int], max_tokens: int | None,
        thinking: bool = False, tool_name: str | None = None, n: int = 1, **extra: Any,
    ) -> formats.Job:  # fmt: skip
        room = self.profile.context_length - len(prompt_ids)
        if not prompt_ids:
            raise RequestError("The prompt is empty.")
        ignore_eos = bool(body.get("ignore_eos"))
        plan = plan_output(self.identity.seed, text, max_tokens, ignore_eos, thinking, room)
        samples = tuple(plan_output(self.identity.seed, f"{text}#{i}", max_tokens, ignore_eos, thinking, room)
                        for i in range(n)) if n > 1 else ()  # fmt: skip
        options = body.get("stream_options") or {}
        model = str(body.get("model") or "default")
        return formats.Job(
            rid=extra.pop("rid", None) or self._rid_of(body),
            model=model,
            created=int(time.time()),
            prompt_ids=prompt_ids,
            plan=plan,
            greedy=body.get("temperature") == 0,
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
            tool_name=tool_name,
            tool_id=formats.new_tool_call_id() if tool_name else "",
            start_error=self._lora_error(model) or self._length_error(len(prompt_ids), max_tokens),
            samples=samples,
            **extra,
        )

    @staticmethod
    def _rid_of(body: dict[str, Any]) -> str:
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError("'rid' must be a string")
        return rid or formats.new_rid()

    def _lora_error(self, model: str) -> str | None:
        """serving_base.py:40 reads `base:adapter` as a LoRA adapter; with LoRA off (as here)
        generate_request raises (tokenizer_manager.py:3729). No other check of the name."""
        served = self.profile.served_model_name
        if ":" not in model or model == served:
            return None
        adapter = model[len(served) + 1 :] if model.startswith(served + ":") else model.split(":", 1)[1]
        if not adapter.strip():
            return None
        return (f"LoRA adapter '{adapter.strip()}' was requested, but LoRA is not enabled. Please "
                "launch the server with --enable-lora flag and preload adapters using --lora-paths "
                "or /load_lora_adapter endpoint.")  # fmt: skip

    def _length_error(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """tokenizer_manager.py:1337-1378 (validate_total_tokens is always on): the prompt must
        be shorter than the context, and prompt + max_new_tokens must fit in it. Raised inside
        generate_request, so a Messages or Responses stream reports it inside its 200."""
        context = self.profile.context_length
        if prompt_tokens >= context:
            return (f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                    f"({context} tokens).")  # fmt: skip
        if max_tokens is not None and prompt_tokens + max_tokens > context:
            return (f"Requested token count exceeds the model's maximum context length of {context} "
                    f"tokens. You requested a total of {prompt_tokens + max_tokens} tokens: "
                    f"{prompt_tokens} tokens from the input messages and {max_tokens} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or the "
                    "completion to fit within the limit.")  # fmt: skip
        return None

    def _parse_chat(self, body: dict[str, Any]) -> formats.Job:
        tools = body.get("tools")
        try:
            text = chat_prompt_text(body.get("messages"), tools)
            tool = chosen_tool(tools, body.get("tool_choice"), _last_is_user(body.get("messages")))
            thinking = thinking_requested(body)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        max_tokens = max_tokens_of(body, "max_completion_tokens", "max_tokens")
        return self._job(body, text, token_ids(text), max_tokens, thinking, tool, choices_of(body))

    def _parse_generate(self, body: dict[str, Any]) -> formats.Job:
        """One prompt (``text`` or ``input_ids``) with ``sampling_params``
        (managers/io_struct.py GenerateReqInput; max_new_tokens defaults to 128)."""
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, str):
            prompt_text, prompt_ids = text, token_ids(text)
        elif isinstance(ids, list) and ids and all(type(t) is int for t in ids):
            prompt_text, prompt_ids = " ".join(map(str, ids)), ids
        elif text is None and ids is None:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        else:
            raise RequestError("The simulator takes one prompt per /generate request (no batches).")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        limit = max_tokens_of({"max_new_tokens": params.get("max_new_tokens", 128)}, "max_new_tokens")
        merged = {**body, "ignore_eos": params.get("ignore_eos"), "temperature": params.get("temperature")}
        return self._job(merged, prompt_text, prompt_ids, limit)

    def _parse_completion(self, body: dict[str, Any]) -> formats.Job:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text, ids = prompt, token_ids(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            text, ids = " ".join(map(str, prompt)), prompt
        else:
            raise RequestError("'prompt' must be a string or a list of token ids")
        return self._job(body, text, ids, max_tokens_of(body, "max_tokens"), n=choices_of(body))

    def _parse_messages(self, body: dict[str, Any]) -> formats.Job:
        """Anthropic requests carry no rid SGLang reads (anthropic/protocol.py:370): each
        gets a fresh one, so only a disconnect can abort it."""
        if not body.get("model"):
            raise RequestError("model: Model is required")
        max_tokens = max_tokens_of(body, "max_tokens")
        if max_tokens is None:
            raise RequestError("max_tokens: Field required")
        text, tool, thinking = self._anthropic_prompt(body)
        return self._job({**body, "rid": None}, text, token_ids(text), max_tokens, thinking, tool)

    def _anthropic_prompt(self, body: dict[str, Any]) -> tuple[str, str | None, bool]:
        """(prompt text, the tool to call or None, thinking) of a Messages request, as
        anthropic/serving.py:218 converts it; conversion errors are 400s."""
        try:
            system = content_text(body.get("system"))
            messages = body.get("messages")
            tools = anthropic_tools(body.get("tools"))
            text = chat_prompt_text(messages, tools or None)
            tool = anthropic_chosen_tool(tools, body.get("tool_choice"), _last_is_user(messages))
            thinking = anthropic_thinking(body.get("thinking"))
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        return (f"{system}\n{text}" if system else text), tool, thinking

    def _parse_responses(self, body: dict[str, Any]) -> formats.Job:
        previous = body.get("previous_response_id")
        if previous is not None and not self.responses_store.enabled:
            raise RequestError(STORE_DISABLED, err_type="invalid_request_error", param="previous_response_id")
        self._check_responses_model(body.get("model"))
        tools = body.get("tools") or []
        try:
            tool = responses_chosen_tool(tools, body.get("tool_choice", "auto"), body.get("input"))
            text = responses_prompt_text(body.get("input"))
        except ValueError as exc:
            raise RequestError(str(exc), param=getattr(exc, "param", None)) from exc
        if previous is not None:
            text = self.responses_store.history(previous) + "\n" + text
        if body.get("instructions"):
            text = f"{body['instructions']}\n{text}"
        rid = body.get("request_id") or f"resp_{uuid.uuid4().hex}"  # protocol.py:1973
        if not isinstance(rid, str):
            raise RequestError("request_id: Input should be a valid string", err_type="Bad Request")
        echo = {key: body[key] for key in formats.RESPONSES_ECHO if key in body}
        store = self.responses_store.enabled and body.get("store", True) is not False
        job = self._job(body, text, token_ids(text), max_tokens_of(body, "max_output_tokens"),
                        thinking_requested(body), tool, rid=rid, echo=echo, store=store,
                        prompt_text=text if store else "")  # fmt: skip
        return dataclasses.replace(job, model=body.get("model") or self.profile.served_model_name)

    def _check_responses_model(self, model: Any) -> None:
        """serving_responses.py:297: None is whatever is loaded; else the served name, or
        `served:adapter`."""
        served = self.profile.served_model_name
        if model is None or model == served or str(model).split(":", 1)[0] == served:
            return
        raise RequestError(f"The model '{model}' does not exist", 404, "invalid_request_error", "model")

    # --- running a job -------------------------------------------------------------------

    async def _generate(self, request: Request, job: formats.Job, stream: bool, api: Api) -> Response:
        started = time.perf_counter()
        status = self.faults.take_failure()
        if status is not None:
            return api.refuse(RequestError("Simulated failure (sim fault).", status, "InternalServerError"))
        try:
            await until_or_disconnect(self.faults.wait_unhung(), request)
        except ClientGone:
            return Response(status_code=499)  # nobody is listening any more
        jobs = samples_of(job)
        failure = self._failure_at_start(job)
        queues: list[asyncio.Queue[Output]] = []
        if failure is None:
            try:
                for one in jobs:
                    engine_request = EngineRequest(one.rid, one.prompt_ids, len(one.plan.words), one.greedy)
                    queues.append(self.live.submit(engine_request))
            except QueueFullError:
                failure = Failure(503, formats.QUEUE_FULL)
            except ValueError as exc:
                failure = Failure(400, str(exc), raised=True)
            if failure is not None:
                for one in jobs[: len(queues)]:
                    self.live.abort(one.rid, exact=True)
        if failure is not None:
            return self._fail(job, stream, api, failure)
        try:
            if len(jobs) > 1:
                return await self._respond_many(request, jobs, stream, queues, started, api)
            return await self._respond(request, job, stream, queues[0], started, api)
        except ClientGone:
            return Response(status_code=499)  # the abort is under way (_client_gone)

    async def _respond_many(
        self, request: Request, jobs: list[formats.Job], stream: bool,
        queues: list[asyncio.Queue[Output]], started: float, api: Api,
    ) -> Response:  # fmt: skip
        """`n > 1`: every sample is a request of its own (a fresh rid each, tokenizer_manager.py
        :2174), answered together (the simulator skips SGLang's prefill-only warm-up request)."""
        if stream:
            events = self._stream_many(jobs, queues, api, started)
            return StreamingResponse(events, media_type="text/event-stream")
        progress = [[0] for _ in jobs]
        collecting = [collect(Output(one.rid, 0), queue, count)
                      for one, queue, count in zip(jobs, queues, progress, strict=True)]  # fmt: skip
        try:
            results = await until_or_disconnect(asyncio.gather(*collecting), request)
        except ClientGone:
            for one, queue, count in zip(jobs, queues, progress, strict=True):
                self._client_gone(one.rid, queue, count[0], stream=False)
            raise
        bodies = []
        for one, (generated, reason) in zip(jobs, results, strict=True):
            self._record(one, generated, reason, started)
            bodies.append(api.body(one, generated, reason))
        return json_response(formats.merge_choices(bodies))

    async def _stream_many(self, jobs: list[formats.Job], queues: list[asyncio.Queue[Output]], api: Api,
                           started: float) -> AsyncIterator[bytes]:  # fmt: skip
        """The choices' chunks as their outputs come (serving_chat.py:2493); chat's finish chunks
        after the last output, all with the id of the choice that finished last, then the usage
        (the prompt counted once) with that id too, then [DONE]."""
        merged: asyncio.Queue[tuple[int, Output]] = asyncio.Queue()
        pumps = [asyncio.create_task(pump(i, queue, merged)) for i, queue in enumerate(queues)]
        renderers = [api.renderer(one) for one in jobs]
        reasons: dict[int, str] = {}
        last = 0
        finished = False
        try:
            while len(reasons) < len(jobs):
                i, output = await merged.get()
                renderer = renderers[i]
                events = [] if renderer.begun else renderer.begin()
                events += renderer.output(output)
                if output.finish_reason is not None:
                    reasons[i], last = output.finish_reason, i
                    self._record(jobs[i], renderer.generated, output.finish_reason, started)
                    if not renderer.finish_after_all:
                        events += renderer.finish(output.finish_reason)
                for event in events:
                    yield event
            for i, renderer in enumerate(renderers):
                if renderer.finish_after_all:
                    named_last = api.renderer(dataclasses.replace(jobs[i], rid=jobs[last].rid))
                    for event in named_last.finish(reasons[i]):
                        yield event
            if jobs[0].include_usage:
                completion = sum(r.generated for r in renderers)
                reasoning = sum(r.reasoning_generated for r in renderers)
                yield renderers[last].usage(jobs[0].prompt_tokens, completion, reasoning)
            yield formats.DONE
            finished = True
        finally:
            for task in pumps:
                task.cancel()
            if not finished:  # cancelled: generate_request aborts every sample at once
                for one in jobs:
                    self.live.disconnect(one.rid)

    def _failure_at_start(self, job: formats.Job) -> Failure | None:
        if job.start_error is not None:  # raised inside generate_request before any output
            return Failure(400, job.start_error, raised=True)
        status = self.faults.take_abort_at_start()
        return None if status is None else Failure(status, "Simulated abort (sim fault).")

    def _fail(self, job: formats.Job, stream: bool, api: Api, failure: Failure) -> Response:
        """A request that ends before its first token (a full queue, a status abort, a raise):
        SGLang answers a stream with HTTP 200 and the error inside (tokenizer_manager.py:1891),
        except where a kick-started stream sees the raise first (serving_chat.py:2422)."""
        if not stream:
            return api.aborted(400 if failure.raised else failure.status, failure.message)
        if failure.raised and api.kick_started:
            return api.refuse(RequestError(failure.message))
        renderer = api.renderer(job)
        if failure.raised:
            events = renderer.raised(failure.message)
        else:
            events = renderer.abort(failure.status, failure.message)
        self._store(job, renderer)
        return StreamingResponse(replay(events), media_type="text/event-stream")

    async def _respond(
        self,
        request: Request,
        job: formats.Job,
        stream: bool,
        queue: asyncio.Queue[Output],
        started: float,
        api: Api,
    ) -> Response:
        if self.faults.faults.crash_after_chunks is not None and not stream:
            self.live.disconnect(job.rid)
            return CrashResponse()
        if stream and not api.kick_started:
            # Messages, Responses and /generate hand their StreamingResponse over at once: the
            # HTTP head (and Responses' created/in_progress) goes out before the first token.
            events = self._stream(job, api.renderer(job), None, queue, started)
            return StreamingResponse(events, media_type="text/event-stream")
        # Chat and completions kick-start the stream: the head waits for the first output.
        try:
            first = await until_or_disconnect(queue.get(), request)
        except ClientGone:
            # Chat/completions (kick-started) and non-stream handlers notice when they wake.
            self._client_gone(job.rid, queue, 0, stream)
            raise
        self.metrics.first_token(time.perf_counter() - started)
        if stream:
            events = self._stream(job, api.renderer(job), first, queue, started)
            return StreamingResponse(events, media_type="text/event-stream")
        progress = [first.tokens]
        try:
            generated, reason = await until_or_disconnect(collect(first, queue, progress), request)
        except ClientGone:
            self._client_gone(job.rid, queue, progress[0], stream=False)
            raise
        self._record(job, generated, reason, started)
        body = api.body(job, generated, reason)
        if job.store:
            self.responses_store.put(job, body)
        return json_response(body)

    async def _stream(
        self,
        job: formats.Job,
        renderer: formats.Renderer,
        output: Output | None,
        queue: asyncio.Queue[Output],
        started: float,
    ) -> AsyncIterator[bytes]:
        """The stream's events from ``output``, the first one, or (None) from the start."""
        faults = self.faults.faults
        budget = _EventBudget(faults.crash_after_chunks, faults.error_after_chunks)
        abort_status = faults.abort_status or 500
        finished = False
        try:
            for event in renderer.begin():
                if budget.spend():
                    break
                yield event
            if output is None:
                output = await queue.get()
                self.metrics.first_token(time.perf_counter() - started)
            last = time.perf_counter()
            while not budget.exhausted:
                for event in renderer.output(output):
                    if budget.spend():
                        break
                    yield event
                now = time.perf_counter()
                if output.tokens and not output.first:
                    self.metrics.chunk(now - last, output.tokens)
                last = now
                if output.finish_reason is not None or budget.exhausted:
                    break
                output = await queue.get()
            if budget.crashed:
                raise SimulatedCrash
            if budget.errored:
                self.live.abort(job.rid, exact=True)
                for event in renderer.abort(abort_status, "Simulated mid-stream failure (sim fault)."):
                    yield event
            else:
                for event in renderer.end(output.finish_reason or "abort"):
                    yield event
                self._record(job, renderer.generated, output.finish_reason or "abort", started)
            self._store(job, renderer)
            finished = True
        finally:
            if not finished:
                # Starlette's disconnect listener cancelled the stream: the CancelledError reaches
                # generate_request, which aborts at once (tokenizer_manager.py:958, :3850); its
                # 2 s background abort (tokenizer_manager.py:2427) then finds nothing left.
                self.live.disconnect(job.rid)
                self._record(job, renderer.generated, "abort", started)

    def _client_gone(self, rid: str, queue: asyncio.Queue[Output], generated: int, stream: bool) -> None:
        """A handler still waiting when its client left (a kick-started stream before its first
        token, a non-stream request) looks only when it wakes (tokenizer_manager.py:1960-1974):
        on an output (a stream's first; a non-stream request's every 50th token,
        SGLANG_FORCE_STREAM_INTERVAL) or after 4 s without one (SGLANG_REQUEST_STATE_WAIT_TIMEOUT).
        A running StreamingResponse is another matter (see _stream's finally)."""
        watcher = asyncio.create_task(self._abort_when_noticed(rid, queue, generated, stream))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _abort_when_noticed(self, rid: str, queue: asyncio.Queue[Output], generated: int,
                                  stream: bool) -> None:  # fmt: skip
        timeout = REQUEST_STATE_WAIT_TIMEOUT_S / self.live.speed
        with contextlib.suppress(TimeoutError):
            while True:
                output = await asyncio.wait_for(queue.get(), timeout)
                if output.finish_reason is not None:
                    return
                generated += output.tokens
                if stream or generated % FORCE_STREAM_INTERVAL == 0:
                    break
        self.live.disconnect(rid)

    def _store(self, job: formats.Job, renderer: formats.Renderer) -> None:
        final = getattr(renderer, "final", None)
        if job.store and final is not None:
            self.responses_store.put(job, final)

    def _record(self, job: formats.Job, generated: int, reason: str, started: float) -> None:
        e2e = time.perf_counter() - started
        self.metrics.finished(job.prompt_tokens, generated, e2e, reason == "abort")

    # --- information endpoints -----------------------------------------------------------

    def _model_card(self) -> dict[str, Any]:
        name = self.profile.served_model_name
        return {"id": name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": self.profile.context_length}  # fmt: skip

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model == self.profile.served_model_name:
            return json_response(self._model_card())
        error = {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                 "param": "model", "code": "model_not_found"}  # fmt: skip
        return json_response({"error": error}, 404)

    async def model_info(self, request: Request) -> Response:
        name = self.profile.served_model_name
        return json_response({
            "model_path": name, "tokenizer_path": name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "served_model_name": name, "reasoning_parser": "qwen3", "tool_call_parser": "qwen3_coder",
        })  # fmt: skip

    async def server_info(self, request: Request) -> Response:
        return json_response(self.server_info_body())

    def server_info_body(self) -> dict[str, Any]:
        p, engine = self.profile, self.live.engine
        spec = p.speculative
        internal: dict[str, Any] = {
            "effective_max_running_requests_per_dp": p.effective_max_running,
            "last_gen_throughput": engine.stats.gen_throughput * self.live.speed,
            "memory_usage": {"weight": 61.2, "kvcache": 20.5, "token_capacity": p.prefix_cache_tokens,
                             "graph": 1.1},
        }  # fmt: skip
        if spec and engine.stats.spec_verify_ct:
            internal["avg_spec_accept_length"] = engine.stats.avg_spec_accept_length
        return {
            "model_path": p.served_model_name, "tokenizer_path": p.served_model_name,
            "served_model_name": p.served_model_name, "host": self.identity.host,
            "port": self.identity.port, "tp_size": 4, "dp_size": 1, "random_seed": self.identity.seed,
            "context_length": p.context_length, "chunked_prefill_size": p.chunked_prefill_size,
            "max_running_requests": p.resolved_max_running_requests,
            "max_queued_requests": p.max_queued_requests,
            "speculative_algorithm": "EAGLE" if spec else None,  # NEXTN resolves to EAGLE
            "speculative_num_steps": p.num_steps if spec else None,
            "speculative_eagle_topk": p.eagle_topk if spec else None,
            "speculative_num_draft_tokens": p.num_draft_tokens if spec else None,
            "mamba_radix_cache_strategy": "extra_buffer", "max_mamba_cache_size": p.mamba_slots,
            "enable_metrics": True, "mem_fraction_static": 0.45 if spec else 0.8,
            "launch_command": self._launch_command(),
            "status": "ready", "max_total_num_tokens": p.prefix_cache_tokens,
            "max_req_input_len": p.context_length - 1, "startup_time": self.started,
            "internal_states": [internal], "version": VERSION, "frontend": "python",
        }  # fmt: skip

    def _launch_command(self) -> str:
        p = self.profile
        command = f"python -m sglang.launch_server --model-path {p.served_model_name} --tp 4"
        command += f" --port {self.identity.port} --enable-metrics"
        if p.speculative:
            command += f" --speculative-algorithm NEXTN --speculative-num-steps {p.num_steps}"
            command += f" --speculative-eagle-topk {p.eagle_topk}"
            command += f" --speculative-num-draft-tokens {p.num_draft_tokens}"
        return command + "  # simulated by mtp-gateway sim"

    async def loads(self, request: Request) -> Response:
        engine, p = self.live.engine, self.profile
        load: dict[str, Any] = {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": engine.num_used_tokens,
            "num_total_tokens": p.prefix_cache_tokens, "max_total_num_tokens": p.prefix_cache_tokens,
            "max_running_requests": p.effective_max_running, "token_usage": engine.kv_token_usage,
            "gen_throughput": engine.stats.gen_throughput * self.live.speed,
            "cache_hit_rate": engine.cache_hit_rate,
            "utilization": engine.num_running / p.effective_max_running,
        }  # fmt: skip
        if p.speculative:
            load["speculative"] = {"accept_length": engine.stats.avg_spec_accept_length,
                                   "accept_rate": engine.stats.spec_accept_rate}  # fmt: skip
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        return json_response({"timestamp": stamp, "version": VERSION, "accelerator": "Simulated GPU",
                              "num_accelerators": 4, "loads": [load]})  # fmt: skip

    async def health(self, request: Request) -> Response:
        """Like SGLang: generate one token, at least ~1 s (scaled); 503 when failing."""
        scale = 1 / self.live.speed  # real seconds per simulated second
        if self.faults.failing:
            return Response(status_code=503)
        probe = self._health_probe()
        floor = asyncio.sleep(HEALTH_MIN_S * scale)
        try:
            ok, _ = await asyncio.wait_for(asyncio.gather(probe, floor), HEALTH_TIMEOUT_S * scale)
        except TimeoutError:
            ok = False
        return Response(status_code=200 if ok else 503)

    async def _health_probe(self) -> bool:
        await self.faults.wait_unhung()
        rid = f"HEALTH_CHECK_{formats.new_rid()}"
        try:
            queue = self.live.submit(EngineRequest(rid, [0], 1))
        except (QueueFullError, ValueError):
            return False
        try:
            return (await queue.get()).finish_reason == "length"
        finally:
            self.live.abort(rid, exact=True)  # after a timeout, do not leave it running

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200)

    async def abort_request(self, request: Request) -> Response:
        """tokenizer_manager.py:2241: an empty rid without abort_all is ignored, and so is a rid
        the server is not running (a prefix, an `n > 1` parent rid, a finished request): only
        a known rid reaches the scheduler, whose prefix match (scheduler.py:5688) then also
        takes the requests it prefixes."""
        try:
            body = await read_json(request)
        except RequestError as exc:
            return openai_error(exc.status, str(exc), exc.err_type)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all"))
        if abort_all or rid in self.live.engine:
            self.live.abort(rid, abort_all)
        return Response(status_code=200)

    # --- the other endpoints a generation model answers ----------------------------------

    async def not_an_embedding_model(self, request: Request) -> Response:
        """Embeddings and classification run as EmbeddingReqInput, which a generation model
        refuses (tokenizer_manager.py:1381) with a ValueError: 400 (serving_embedding.py:259)."""
        try:
            await read_json(request)
        except RequestError as exc:
            return _openai_refusal(exc)
        return openai_error(400, NOT_AN_EMBEDDING_MODEL, "BadRequestError")

    async def tokenize(self, request: Request) -> Response:
        """serving_tokenize.py: ``prompt`` (a string or strings) or chat ``messages``; the
        simulator's tokens are words, numbered as they are first seen (so detokenize inverts)."""
        try:
            body = await read_json(request)
            prompt, messages = body.get("prompt"), body.get("messages")
            if messages is not None:
                tokens: Any = self.vocabulary.encode(chat_prompt_text(messages, body.get("tools")))
            elif isinstance(prompt, str):
                tokens = self.vocabulary.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [self.vocabulary.encode(p) for p in prompt]
            else:
                raise RequestError("Either 'prompt' or 'messages' must be provided")
        except (RequestError, ValueError) as exc:
            return _openai_refusal(exc if isinstance(exc, RequestError) else RequestError(str(exc)))
        count = len(tokens) if isinstance(prompt, str) or messages is not None else [len(t) for t in tokens]
        return json_response({"tokens": tokens, "count": count, "max_model_len": self.profile.context_length})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            tokens = body.get("tokens")
            if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                text: Any = self.vocabulary.decode(tokens)
            elif isinstance(tokens, list) and all(isinstance(t, list) for t in tokens):
                text = [self.vocabulary.decode(t) for t in tokens]
            else:
                raise RequestError("tokens: Input should be a list of integers or of lists of integers",
                                   err_type="Bad Request")  # fmt: skip
        except RequestError as exc:
            return _openai_refusal(exc)
        return json_response({"text": text})

    # --- Anthropic token counting and stored responses -----------------------------------

    async def count_tokens(self, request: Request) -> Response:
        """anthropic/serving.py:1439: the converted prompt's length."""
        try:
            body = await read_json(request)
            if not body.get("model"):
                raise RequestError("model: Field required")
            text, _, _ = self._anthropic_prompt(body)
        except RequestError as exc:
            return _anthropic_refusal(exc)
        return json_response({"input_tokens": len(token_ids(text))})

    async def get_response(self, request: Request) -> Response:
        try:
            return json_response(self.responses_store.get(request.path_params["response_id"]))
        except RequestError as exc:
            return _responses_refusal(exc)

    async def cancel_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            body, running = self.responses_store.cancel(response_id)
        except RequestError as exc:
            return _responses_refusal(exc)
        if running:  # the response id is the rid (serving_responses.py:1929)
            self.live.abort(response_id, exact=True)
        return json_response(body)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --- sim admin -----------------------------------------------------------------------

    async def set_faults(self, request: Request) -> Response:
        try:
            faults = Faults.from_json(await read_json(request))
        except (RequestError, ValueError, TypeError) as exc:
            return openai_error(400, str(exc), "BadRequestError")
        await self.faults.set(faults)
        return json_response({"faults": asdict(faults)})

    async def clear_faults(self, request: Request) -> Response:
        await self.faults.clear()
        return json_response({"faults": asdict(self.faults.faults)})

    async def state(self, request: Request) -> Response:
        engine = self.live.engine
        return json_response({
            "backend": self.identity.name, "faults": asdict(self.faults.faults),
            "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,
            "effective_max_running_requests": self.profile.effective_max_running,
            "generated_tokens": engine.stats.generated_tokens,
            "avg_spec_accept_length": engine.stats.avg_spec_accept_length,
            "speed": self.live.speed,
        })  # fmt: skip


class _EventBudget:
    """Counts stream events against the crash / error faults in force when the stream began."""

    def __init__(self, crash_after: int | None, error_after: int | None) -> None:
        self._crash_after, self._error_after = crash_after, error_after
        self.sent = 0
        self.crashed = self.errored = False

    def spend(self) -> bool:
        """True when the next event must not be sent (and records why)."""
        if self._crash_after is not None and self.sent >= self._crash_after:
            self.crashed = True
        elif self._error_after is not None and self.sent >= self._error_after:
            self.errored = True
        else:
            self.sent += 1
        return self.exhausted

    @property
    def exhausted(self) -> bool:
        return self.crashed or self.errored


# --- helpers --------------------------------------------------------------------------------


def samples_of(job: formats.Job) -> list[formats.Job]:
    """The requests an `n > 1` job becomes: fresh rids, the choice index, each its own answer."""
    if len(job.samples) < 2:
        return [job]
    return [dataclasses.replace(job, rid=formats.new_rid(), plan=plan, index=i, samples=(),
                                tool_id=formats.new_tool_call_id() if job.tool_name else "")
            for i, plan in enumerate(job.samples)]  # fmt: skip


async def pump(index: int, queue: asyncio.Queue[Output], merged: asyncio.Queue[tuple[int, Output]]) -> None:
    while True:
        output = await queue.get()
        merged.put_nowait((index, output))
        if output.finish_reason is not None:
            return


async def collect(first: Output, queue: asyncio.Queue[Output], progress: list[int]) -> tuple[int, str]:
    """Read a request's outputs to the end: (tokens generated, engine finish reason);
    ``progress[0]`` counts the tokens as they come."""
    output = first
    while output.finish_reason is None:
        output = await queue.get()
        progress[0] += output.tokens
    return progress[0], output.finish_reason


class ClientGone(Exception):
    """The client disconnected while the handler was waiting."""


async def until_or_disconnect(work: Awaitable[T], request: Request) -> T:
    """``work``'s result; raises ClientGone (and cancels ``work``) if the client goes first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pending
    if task.cancelled():
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
