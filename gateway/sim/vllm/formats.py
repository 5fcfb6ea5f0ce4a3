"""vLLM 0.33.0's wire formats: chat and completions chunks (pydantic ``model_dump_json`` with
``exclude_unset``, compact), their non-stream bodies, the nested error, and the Messages events
its Anthropic converter makes of the chat stream. Paths are under ``vllm/``; docs/compat.md's
vLLM section has a row per behaviour.

The renderers follow the SGLang simulator's (``gateway.sim.formats.Renderer``: ``begin``,
``output``, ``end``, ``abort``) and share its text cursor, so the same engine outputs read the
same words on either engine.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from gateway.sim import formats
from gateway.sim.formats import DONE, Job, Renderer, compact, tool_arguments
from gateway.sim.text import split_answer

# entrypoints/anthropic/protocol.py:34-53 (translate_error_type): the status's Anthropic type,
# api_error for another 5xx, invalid_request_error for another 4xx.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
# A finish_reason "error" in a stream is a GenerationError (generate/base/serving.py:197-205).
GENERATION_ERROR = "Internal server error"


def random_uuid() -> str:
    """vllm.utils.random_uuid: a uuid4's hex."""
    return uuid.uuid4().hex


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """entrypoints/serve/engine/protocol.py:79-86 (ErrorResponse), error_response.py:98-104."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def anthropic_error_type(status: int) -> str:
    if status in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """entrypoints/anthropic/api_router.py:40-49 (translate_error_response)."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def error_chunk(status: int, message: str, err_type: str) -> bytes:
    """chat/serving.py:494-507: the ErrorResponse as a chunk, ``model_dump_json`` (compact)."""
    return b"data: " + compact(error_body(status, message, err_type)).encode() + b"\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    """UsageInfo's set fields in field order (entrypoints/serve/engine/protocol.py:135-140)."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion}


def _head(job: Job, object_name: str) -> str:
    return (f'data: {{"id":{json.dumps(job.rid)},"object":"{object_name}","created":{job.created},'
            f'"model":{json.dumps(job.model)},"choices":[')  # fmt: skip


class VllmChatRenderer(Renderer):
    """``/v1/chat/completions`` chunks (chat/serving.py:514-918): the role chunk at the first
    output, a ``content`` or ``reasoning`` delta per output, the finish in the last output's
    chunk, the usage chunk only when asked, then ``[DONE]``; an error is its chunk then
    ``[DONE]`` (no usage after it)."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._head = _head(job, "chat.completion.chunk")
        self._tool_started = False

    def begin(self) -> list[bytes]:
        """chat/serving.py:596-625: role and "" content; prompt_token_ids and prompt_text set
        (to null), so exclude_unset keeps them."""
        self.begun = True
        choice = '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
        return [(self._head + choice + '],"prompt_token_ids":null,"prompt_text":null}\n\n').encode()]

    def output(self, output: Any) -> list[bytes]:
        self.generated += output.tokens
        deltas = [self._delta(kind, text) for kind, text in self.cursor.take(output.tokens)]
        if output.finish_reason is not None:
            self._last = deltas.pop() if deltas else "{}"
        return [self._chunk(delta, None) for delta in deltas]

    _last = "{}"  # the delta of the final output's last piece, sent with the finish reason

    def _delta(self, kind: str, text: str) -> str:
        if kind == "reasoning":
            return '{"reasoning":"' + text + '"}'  # generate/base/protocol.py:356-360
        if self.job.tool_name is None:
            return '{"content":"' + text + '"}'
        args = tool_arguments(text, not self._tool_started, self.cursor.at_end)
        call: dict[str, Any] = {"index": 0, "function": {"arguments": args}}
        if not self._tool_started:  # DeltaToolCall (generate/base/protocol.py:337-341)
            self._tool_started = True
            call = {"id": self.job.tool_id, "type": "function", "index": 0,
                    "function": {"name": self.job.tool_name, "arguments": args}}  # fmt: skip
        return '{"tool_calls":' + compact([call]) + "}"

    def _chunk(self, delta: str, reason: str | None) -> bytes:
        if reason is None:  # chat/serving.py:782-791
            choice = '{"index":0,"delta":' + delta + ',"logprobs":null,"finish_reason":null,"token_ids":null}'
        else:  # chat/serving.py:794-813
            choice = ('{"index":0,"delta":' + delta + f',"logprobs":null,"finish_reason":"{reason}",'
                      '"stop_reason":null,"token_ids":null,"weight_versions":null}')  # fmt: skip
        return (self._head + choice + '],"kv_transfer_params":null}\n\n').encode()

    def end(self, engine_reason: str) -> list[bytes]:
        events = [self._chunk(self._last, self.job.finish_reason(engine_reason))]
        if self.job.include_usage:  # chat/serving.py:862-918, exclude_none
            events.append((self._head + '],"usage":' + compact(usage(self.job.prompt_tokens, self.generated))
                           + "}\n\n").encode())  # fmt: skip
        return events + [DONE]

    def abort(self, status: int, message: str) -> list[bytes]:
        """A GenerationError inside the stream (chat/serving.py:947-950): its chunk, [DONE]."""
        err_type = "ServiceUnavailableError" if status == 503 else "InternalServerError"
        return [error_chunk(status, message, err_type), DONE]

    def raised(self, message: str) -> list[bytes]:
        return [error_chunk(400, message, "BadRequestError"), DONE]


class VllmCompletionRenderer(VllmChatRenderer):
    """``/v1/completions`` chunks (completion/serving.py:438-558): no role chunk, a text
    chunk per output with every choice field set, the usage chunk dumped with exclude_none."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._head = _head(job, "text_completion")

    def begin(self) -> list[bytes]:
        self.begun = True
        return []

    def output(self, output: Any) -> list[bytes]:
        self.generated += output.tokens
        text = "".join(text for _, text in self.cursor.take(output.tokens))
        if output.finish_reason is not None:
            self._last = text
            return []
        return [self._chunk(text, None)]

    def _chunk(self, delta: str, reason: str | None) -> bytes:
        finish = "null" if reason is None else f'"{reason}"'
        choice = (f'{{"index":0,"text":"{delta}","logprobs":null,"finish_reason":{finish},"stop_reason":null,'
                  '"prompt_token_ids":null,"token_ids":null,"weight_versions":null}')  # fmt: skip
        return (self._head + choice + '],"kv_transfer_params":null}\n\n').encode()

    _last = ""


class VllmMessagesRenderer(formats.MessagesRenderer):
    """``/v1/messages`` events as vLLM converts its chat stream (anthropic/serving.py:918-1247):
    ``message_start`` at the chat stream's first chunk, with the chat id, null stop fields and
    the prompt tokens (the converter asks for continuous usage, :702-714); the same blocks; the
    ``message_delta`` with ``stop_sequence`` set; an error closes the open block and is
    ``event: error``, with **no** ``message_stop`` after it (:1228-1247)."""

    def begin(self) -> list[bytes]:
        self.begun = True
        self._started = True
        message: dict[str, Any] = {"id": self.job.rid, "type": "message", "role": "assistant", "content": [],
                   "model": self.job.model, "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.job.prompt_tokens, "output_tokens": 0}}  # fmt: skip
        return [self._event({"type": "message_start", "message": message})]

    def end(self, engine_reason: str) -> list[bytes]:
        stop = formats.ANTHROPIC_STOP.get(self.job.finish_reason(engine_reason), "end_turn")
        events = self._close_block()
        delta = {"stop_reason": stop, "stop_sequence": None}
        events.append(self._event({"type": "message_delta", "delta": delta,
                                   "usage": {"input_tokens": self.job.prompt_tokens,
                                             "output_tokens": self.generated}}))  # fmt: skip
        events.append(self._event({"type": "message_stop"}))
        return events

    def abort(self, status: int, message: str) -> list[bytes]:
        return self._close_block() + [self._event(anthropic_error_body(status, message))]


def chat_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """ChatCompletionResponse.model_dump() (chat/protocol.py:76-165), every field."""
    reasoning, content = split_answer(job.plan, generated)
    message: dict[str, Any] = {"role": "assistant", "content": content or None, "refusal": None,
                               "annotations": None, "audio": None, "function_call": None}  # fmt: skip
    if job.tool_name is not None:  # an empty tool_calls list is dropped (chat/protocol.py:88-93)
        message["content"] = None
        function = {"name": job.tool_name, "arguments": tool_arguments(content, True, True)}
        message["tool_calls"] = [{"id": job.tool_id, "type": "function", "function": function}]
    message["reasoning"] = reasoning or None
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": job.finish_reason(engine_reason), "stop_reason": None, "token_ids": None,
              "routed_experts": None, "weight_versions": None}  # fmt: skip
    return {"id": job.rid, "object": "chat.completion", "created": job.created, "model": job.model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": full_usage(job.prompt_tokens, generated), "prompt_logprobs": None,
            "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}  # fmt: skip


def completion_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """CompletionResponse.model_dump() (completion/protocol.py:675-721)."""
    choice = {"index": 0, "text": "".join(split_answer(job.plan, generated)), "logprobs": None,
              "finish_reason": job.finish_reason(engine_reason), "stop_reason": None,
              "prompt_logprobs": None}  # fmt: skip
    return {"id": job.rid, "object": "text_completion", "created": job.created, "model": job.model,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": full_usage(job.prompt_tokens, generated), "kv_transfer_params": None,
            "ec_transfer_params": None}  # fmt: skip


def full_usage(prompt: int, completion: int) -> dict[str, Any]:
    return {**usage(prompt, completion), "prompt_tokens_details": None, "completion_tokens_details": None}


def messages_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """The converted chat response, dumped with exclude_none (anthropic/api_router.py:82-85):
    the SGLang simulator's Anthropic body under the chat id."""
    body = formats.anthropic_message(job, generated, engine_reason)
    return {**body, "id": job.rid}

