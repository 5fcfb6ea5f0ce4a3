"""The generation endpoints of a simulated vLLM 0.33.0 server: chat, completions, Messages and
Responses. Bodies are parsed by the SGLang simulator's parser (the same prompts give the same
answers on either engine) with vLLM's checks in place of SGLang's: the model name (404), the
context (400 ``input_tokens``), ``max_tokens`` clamped rather than refused, no LoRA syntax.

Every stream's 200 goes out before the first token (the handler returns its StreamingResponse
at once, chat_completion/api_router.py:66-86); a client that leaves cancels the handler and the
request is aborted (entrypoints/serve/utils/api_utils.py:53-100, v1/engine/async_llm.py:805-812).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.sim import formats as sglang_formats
from gateway.sim.clients import ClientGone, until_or_disconnect
from gateway.sim.context import ServerContext
from gateway.sim.engine import Output
from gateway.sim.engine import Request as EngineRequest
from gateway.sim.generation import collect
from gateway.sim.parsing import JobParser
from gateway.sim.replies import SimulatedCrash, json_response
from gateway.sim.requests import RequestError, read_json, stream_flag
from gateway.sim.tokenize import Tokenization
from gateway.sim.vllm import formats, responses


class VllmJobParser(JobParser):
    """The SGLang simulator's parser with vLLM's checks."""

    def _lora_error(self, model: str) -> str | None:
        return None  # no `base:adapter` syntax: an unknown name is a 404 (_check_model)

    def _length_error(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """renderers/params.py:538-551: only the prompt is checked; max_tokens is clamped to
        what the context leaves (entrypoints/serve/utils/api_utils.py:233-270)."""
        context = self.profile.context_length
        if prompt_tokens <= context:
            return None
        return (f"This model's maximum context length is {context} tokens. However, your prompt "
                f"contains {prompt_tokens} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.")  # fmt: skip

    def _check_responses_model(self, model: Any) -> None:
        return None  # every API checks the name the same way (VllmGeneration._model_error)

    def responses(self, body: dict[str, Any]) -> sglang_formats.Job:
        """The SGLang simulator's parse without its store checks (vLLM refuses a
        ``previous_response_id`` after the model check, ``responses.refusal``), answered with
        vLLM's echo of the request."""
        responses.check_body(body)
        job = super().responses({key: value for key, value in body.items() if key != "previous_response_id"})
        room = max(self.profile.context_length - job.prompt_tokens, 0)
        asked = body.get("max_output_tokens")
        limit = room if not isinstance(asked, int) else min(asked, room)
        return dataclasses.replace(job, echo=responses.effective_echo(body, limit), store=False)


@dataclass(frozen=True)
class VllmApi:
    parse: Callable[[dict[str, Any]], sglang_formats.Job]
    renderer: Callable[[sglang_formats.Job], sglang_formats.Renderer]
    body: Callable[[sglang_formats.Job, int, str], dict[str, Any]]
    id_prefix: str  # the request id's prefix (chat/serving.py:320-322, completion/serving.py:147)
    anthropic: bool = False  # errors from the handler in Anthropic's envelope
    stream_optional: bool = False
    # what the handler refuses after the model check (a Responses request's store use)
    refusal: Callable[[dict[str, Any]], RequestError | None] = lambda body: None


class VllmGeneration:
    def __init__(self, context: ServerContext) -> None:
        self.context = context
        self.live = context.live
        self.faults = context.faults
        self.profile = context.profile
        self.parser = VllmJobParser(context)
        self.tokenization = Tokenization(context, self.parser)
        self.apis = {
            "chat": VllmApi(self.parser.chat, formats.VllmChatRenderer, formats.chat_body, "chatcmpl-"),
            "completions": VllmApi(self.parser.completion, formats.VllmCompletionRenderer,
                                   formats.completion_body, "cmpl-"),
            # The Messages API is the chat handler behind a converter (anthropic/serving.py:822-852).
            "messages": VllmApi(self.parser.messages, formats.VllmMessagesRenderer, formats.messages_body,
                                "chatcmpl-", anthropic=True, stream_optional=True),
            "responses": VllmApi(self.parser.responses, responses.VllmResponsesRenderer,
                                 responses.response_body, "resp_", stream_optional=True,
                                 refusal=responses.refusal),
        }  # fmt: skip

    def routes(self) -> list[Route]:
        post = ["POST"]
        return [Route(f"/v1/{name.replace('chat', 'chat/completions')}", self._endpoint(api), methods=post)
                for name, api in self.apis.items()] + [
            Route("/v1/messages/count_tokens", self.tokenization.count_tokens, methods=post),
        ]  # fmt: skip

    def _endpoint(self, api: VllmApi) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            return await self._serve(request, api)

        return endpoint

    async def _serve(self, request: Request, api: VllmApi) -> Response:
        try:
            body = await read_json(request)
            stream = stream_flag(body, api.stream_optional)
            job = api.parse(body)
        except RequestError as exc:
            return validation_error(exc)
        refusal = self._model_error(job.model)
        if refusal is None:
            refusal = api.refusal(body)
        if refusal is None and job.start_error is not None:
            refusal = RequestError(job.start_error, param="input_tokens")
        if refusal is not None:
            return self._refuse(api, refusal)
        rid = request.headers.get("x-request-id") or formats.random_uuid()  # serving.py:133-142
        # Every answer names the served model, whatever the request said (chat/serving.py:330,
        # models.model_name).
        job = dataclasses.replace(job, model=self.profile.served_model_name,
                                  rid=job.rid if api.id_prefix == "resp_" else api.id_prefix + rid)
        status = self.faults.take_failure()
        if status is not None:
            return self._refuse(api, RequestError("Simulated failure (sim fault).", status,
                                                  "InternalServerError"))  # fmt: skip
        try:
            await until_or_disconnect(self.faults.wait_unhung(), request)
        except ClientGone:
            return Response(status_code=499)
        queue = self.live.submit(EngineRequest(job.rid, job.prompt_ids, len(job.plan.words), job.greedy))
        if stream:
            return StreamingResponse(self._stream(job, api.renderer(job), queue),
                                     media_type="text/event-stream")  # fmt: skip
        progress = [0]
        try:
            first = await until_or_disconnect(queue.get(), request)
            progress[0] = first.tokens
            generated, reason = await until_or_disconnect(collect(first, queue, progress), request)
        except ClientGone:
            self.live.disconnect(job.rid)  # with_cancellation cancels the handler at once
            return Response(status_code=499)
        return json_response(api.body(job, generated, reason))

    def _model_error(self, model: str) -> RequestError | None:
        """entrypoints/serve/engine/serving.py:49-90: empty is the served model; another name
        than the served one is a 404 with param "model"."""
        served = self.profile.served_model_name
        if model in ("", "default", served):
            return None
        return RequestError(f"The model `{model}` does not exist. Valid aliases: {served}.", 404,
                            "NotFoundError", "model")  # fmt: skip

    @staticmethod
    def _refuse(api: VllmApi, exc: RequestError) -> Response:
        if api.anthropic:  # anthropic/api_router.py:40-49, 77-81
            return json_response(formats.anthropic_error_body(exc.status, str(exc)), exc.status)
        return json_response(formats.error_body(exc.status, str(exc), exc.err_type, exc.param), exc.status)

    async def _stream(self, job: sglang_formats.Job, renderer: sglang_formats.Renderer,
                      queue: asyncio.Queue[Output]) -> AsyncIterator[bytes]:  # fmt: skip
        """The events of one stream: the first ones at the first engine output (chat's role
        chunk, Messages' message_start), then each output's, then the end; under the sim's
        faults, an error chunk (a GenerationError) or a dropped connection after N events."""
        faults = self.faults.faults
        crash_after, error_after = faults.crash_after_chunks, faults.error_after_chunks
        sent = 0
        finished = False
        try:
            output = await queue.get()
            events = renderer.begin()
            while True:
                events += renderer.output(output)
                if output.finish_reason is not None:
                    events += renderer.end(output.finish_reason)
                for event in events:
                    if crash_after is not None and sent >= crash_after:
                        raise SimulatedCrash
                    if error_after is not None and sent >= error_after:
                        self.live.abort(job.rid, exact=True)
                        status = faults.abort_status or 500
                        for error_event in renderer.abort(status, formats.GENERATION_ERROR):
                            yield error_event
                        finished = True
                        return
                    sent += 1
                    yield event
                if output.finish_reason is not None:
                    break
                output = await queue.get()
                events = []
            finished = True
        finally:
            if not finished:
                self.live.disconnect(job.rid)


def validation_error(exc: RequestError) -> Response:
    """FastAPI's RequestValidationError, answered by vLLM's handler on every route
    (entrypoints/serve/exception_handling/handlers/validation.py:149-195): 400, type
    "Bad Request", the location as param; errors the handler raises itself keep their type."""
    if exc.err_type != "Bad Request":
        return json_response(formats.error_body(exc.status, str(exc), exc.err_type, exc.param), exc.status)
    param = f"body.{exc.param}" if exc.param else None
    return json_response(formats.error_body(400, f"1 validation error:\n  {exc}", "Bad Request", param), 400)
