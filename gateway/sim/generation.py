"""The generation endpoints of a simulated server (chat, completions, Messages, Responses,
/generate): parse, submit to the engine, answer as each API does, stream or not, with the
faults in force and the client's disconnect noticed when SGLang would notice it.

One module of ~470 lines on purpose: every generation endpoint shares one submit path, one
way of noticing the client leave and one set of faults; split, each would repeat them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.sim import formats
from gateway.sim.clients import ClientGone, until_or_disconnect
from gateway.sim.context import ServerContext
from gateway.sim.engine import Output, QueueFullError
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.parsing import JobParser
from gateway.sim.replies import (
    CrashResponse,
    SimulatedCrash,
    anthropic_aborted,
    anthropic_refusal,
    generate_aborted,
    generate_refusal,
    json_response,
    openai_aborted,
    openai_refusal,
    responses_aborted,
    responses_refusal,
)
from gateway.sim.requests import RequestError, read_json, stream_flag

REQUEST_STATE_WAIT_TIMEOUT_S = 4.0  # environ.py:1679, how often a waiting handler wakes
FORCE_STREAM_INTERVAL = 50  # environ.py:688, a non-stream request's output every 50 tokens


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


class Generation:
    """The generation endpoints of one server, and the Responses API's stored responses."""

    def __init__(self, context: ServerContext, parser: JobParser) -> None:
        self.live = context.live
        self.faults = context.faults
        self.profile = context.profile
        self.metrics = context.metrics
        self.responses_store = context.responses_store
        self.header_overrides = context.header_overrides
        self.parser = parser
        self.apis = self._apis()
        self._watchers: set[asyncio.Task[None]] = set()

    def routes(self) -> list[Route]:
        post = ["POST"]
        return [
            Route("/v1/chat/completions", self.chat, methods=post),
            Route("/v1/completions", self.completions, methods=post),
            Route("/v1/messages", self.messages, methods=post),
            Route("/v1/responses", self.responses, methods=post),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=post),
            Route("/generate", self.generate, methods=["POST", "PUT"]),
        ]

    def _apis(self) -> dict[str, Api]:
        parser, chat_aborted = self.parser, openai_aborted
        return {
            "chat": Api(parser.chat, formats.ChatRenderer, formats.chat_body, openai_refusal,
                        chat_aborted, kick_started=True, stream_optional=False, header_overrides=True),
            "completions": Api(parser.completion, formats.CompletionRenderer, formats.completion_body,
                               openai_refusal, chat_aborted, kick_started=True, stream_optional=False),
            "messages": Api(parser.messages, formats.MessagesRenderer, formats.anthropic_message,
                            anthropic_refusal, anthropic_aborted, header_overrides=True),
            "responses": Api(parser.responses, formats.ResponsesRenderer,
                             formats.responses_final_body, responses_refusal, responses_aborted),
            "generate": Api(parser.generate, self._generate_renderer, formats.generate_body,
                            generate_refusal, generate_aborted, stream_optional=False,
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

    # --- stored responses (--enable-response-store) ---------------------------------------

    async def get_response(self, request: Request) -> Response:
        try:
            return json_response(self.responses_store.get(request.path_params["response_id"]))
        except RequestError as exc:
            return responses_refusal(exc)

    async def cancel_response(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        try:
            body, running = self.responses_store.cancel(response_id)
        except RequestError as exc:
            return responses_refusal(exc)
        if running:  # the response id is the rid (serving_responses.py:1929)
            self.live.abort(response_id, exact=True)
        return json_response(body)

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
        renderers = [choices_renderer(api.renderer(one)) for one in jobs]
        pumps = [asyncio.create_task(pump(i, queue, merged)) for i, queue in enumerate(queues)]
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
                    named = dataclasses.replace(jobs[i], rid=jobs[last].rid)
                    named_last = choices_renderer(api.renderer(named))
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


# --- helpers ---------------------------------------------------------------------------------


def samples_of(job: formats.Job) -> list[formats.Job]:
    """The requests an `n > 1` job becomes: fresh rids, the choice index, each its own answer."""
    if len(job.samples) < 2:
        return [job]
    return [dataclasses.replace(job, rid=formats.new_rid(), plan=plan, index=i, samples=(),
                                tool_id=formats.new_tool_call_id() if job.tool_name else "")
            for i, plan in enumerate(job.samples)]  # fmt: skip


def choices_renderer(renderer: formats.Renderer) -> formats.ChoicesRenderer:
    # Only chat and completions take `n > 1` (parsing.py's choices_of), and theirs finish choices.
    assert isinstance(renderer, formats.ChoicesRenderer)
    return renderer


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
