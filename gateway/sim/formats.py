"""Wire formats: SGLang 0.5.23's OpenAI chunks, Anthropic Messages and OpenAI Responses events.

One module of ~700 lines on purpose: the three APIs' renderers are built from one set of
pre-built byte pieces and one error shape per API, and docs/compat.md quotes them side by side.

A renderer turns engine outputs into SSE events (bytes). Chunk bytes are assembled from
pre-built pieces, because 128 streams share two cores with the gateway and the load generator;
the text pieces are ASCII words (see text.WORDS), so they go into JSON strings unescaped.
Source references (file:line) are SGLang 0.5.23's, under ``sglang/srt/``; docs/compat.md has
the full table.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from gateway.sim.engine import Output
from gateway.sim.text import IM_END_TOKEN_ID, WORDS, Plan, TextCursor, split_answer

DONE = b"data: [DONE]\n\n"
QUEUE_FULL = "The request queue is full."  # managers/scheduler.py:3562

# entrypoints/anthropic/serving.py:74 (ERROR_TYPE_MAP) and :68 (STOP_REASON_MAP; the rest,
# "abort" included, falls back to end_turn).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         408: "request_timeout_error", 429: "rate_limit_error", 500: "api_error",
                         502: "api_error", 503: "overloaded_error", 504: "api_error"}  # fmt: skip
ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Request fields a Responses body repeats (protocol.py:2367, from_request).
RESPONSES_ECHO = ("parallel_tool_calls", "tool_choice", "tools", "instructions", "max_output_tokens",
                  "previous_response_id", "store", "temperature", "top_p", "truncation", "user",
                  "metadata")  # fmt: skip


@dataclass(frozen=True)
class Job:
    """One parsed generation request, whatever the protocol."""

    rid: str
    model: str
    created: int
    prompt_ids: list[int]
    plan: Plan
    greedy: bool = False
    include_usage: bool = False
    tool_name: str | None = None
    tool_id: str = ""  # set with tool_name: new_tool_call_id()
    echo: dict[str, Any] = field(default_factory=dict)  # request fields a Responses body repeats
    start_error: str | None = None  # what generate_request raises before any output (a 400)
    store: bool = False  # a Responses request kept in the server's response store
    prompt_text: str = ""  # kept for a stored response's follow-ups only
    index: int = 0  # the choice, for `n > 1`
    samples: tuple[Plan, ...] = ()  # `n > 1`: each sample's own answer

    def finish_reason(self, engine_reason: str) -> str:
        """Engine "length" means the plan ran out: a natural stop, the length limit or a tool
        call (a stop after tool calls is reported as "tool_calls", serving_chat.py:2646)."""
        if engine_reason == "abort":
            return "abort"
        if self.tool_name and self.plan.finish_reason == "stop":
            return "tool_calls"
        return self.plan.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def new_tool_call_id() -> str:
    """serving_chat.py:3139: a fresh "call_" + 24 hex digits of a uuid4 per tool call."""
    return f"call_{uuid.uuid4().hex[:24]}"


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def openai_error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    error_type = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def responses_error_body(status: int, message: str, err_type: str = "invalid_request_error",
                         param: str | None = None) -> dict[str, Any]:  # fmt: skip
    """serving_responses.py:246: the nested error of /v1/responses."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def streaming_error_event(status: int, message: str) -> bytes:
    """serving_base.py:223 with the abort's HTTPStatus name as type (serving_chat.py:2568);
    json.dumps with its default spaces, unlike the chunks."""
    error = openai_error_body(status, message, HTTPStatus(status).name)
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\n"


def matched_stop(reason: str) -> int | None:
    return IM_END_TOKEN_ID if reason in ("stop", "tool_calls") else None


def chat_usage(prompt: int, completion: int, reasoning: int) -> dict[str, Any]:
    details = {"reasoning_tokens": reasoning} if reasoning else None
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": reasoning,
        "completion_tokens_details": details,
    }


def tool_arguments(content: str, at_start: bool, at_end: bool) -> str:
    """A tool call's JSON arguments, cut the same way as the content they replace."""
    return ('{"text": "' if at_start else "") + content + ('"}' if at_end else "")


class Renderer:
    """Events of one stream: ``begin`` with the first output, ``output`` per engine output,
    ``end`` after the last, ``abort`` for SGLang's abort with an HTTP status (a full queue, a
    scheduler error), which may come before ``begin`` or between outputs."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cursor = TextCursor(job.plan)
        self.generated = 0
        self.begun = False

    def begin(self) -> list[bytes]:
        self.begun = True
        return []

    def output(self, output: Output) -> list[bytes]:
        self.generated += output.tokens
        events = []
        for kind, text in self.cursor.take(output.tokens):
            events += self._segment(kind, text)
        return events

    def _segment(self, kind: str, text: str) -> list[bytes]:
        raise NotImplementedError

    def end(self, engine_reason: str) -> list[bytes]:
        raise NotImplementedError

    def abort(self, status: int, message: str) -> list[bytes]:
        raise NotImplementedError

    def raised(self, message: str) -> list[bytes]:
        """generate_request raised (a ValueError, a 400) inside a stream already answered."""
        return self.abort(400, message)

    @property
    def reasoning_generated(self) -> int:
        return min(self.generated, self.job.plan.reasoning_tokens)

    @property
    def reported_prompt_tokens(self) -> int:
        """An abort before the first output comes from the waiting queue, whose abort output
        has no prompt_tokens (tokenizer_manager.py:3603), so SGLang's usage says 0."""
        return self.job.prompt_tokens if self.begun else 0


def _chunk_head(job: Job, object_name: str) -> str:
    """`data: {"id":...,"object":...,"created":...,"model":...,"choices":` of every chunk."""
    return (f'data: {{"id":{json.dumps(job.rid)},"object":"{object_name}",'
            f'"created":{job.created},"model":{json.dumps(job.model)},"choices":')


class ChoicesRenderer(Renderer):
    """A renderer of an API that takes ``n > 1`` (chat, completions): with several choices the
    caller finishes each and sends the usage itself, after the outputs of them all."""

    finish_after_all: bool  # each choice's finish waits for the last output of every choice

    def finish(self, engine_reason: str) -> list[bytes]:
        raise NotImplementedError

    def usage(self, prompt: int, completion: int, reasoning: int) -> bytes:
        raise NotImplementedError


class ChatRenderer(ChoicesRenderer):
    """``/v1/chat/completions`` chunks: role, content (several tokens per MTP chunk), finish, usage."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        head = _chunk_head(job, "chat.completion.chunk")
        self._head = head + f'[{{"index":{job.index},"delta":'
        self._usage_head = head + '[],"usage":'
        self._tail = ',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
        self._tool_started = False

    def begin(self) -> list[bytes]:
        self.begun = True
        delta = '{"reasoning_content":null,"role":"assistant","content":""}'
        return [(self._head + delta + self._tail).encode()]

    def _segment(self, kind: str, text: str) -> list[bytes]:
        if kind == "reasoning":
            return [(self._head + '{"reasoning_content":"' + text + '"}' + self._tail).encode()]
        if self.job.tool_name is None:
            delta = '{"reasoning_content":null,"content":"' + text + '"}'
            return [(self._head + delta + self._tail).encode()]
        return [self._tool_chunk(text)]

    def _tool_chunk(self, text: str) -> bytes:
        """Tool-call chunks are pydantic dumps (serving_chat.py:3703): every delta key, usage."""
        args = tool_arguments(text, not self._tool_started, self.cursor.at_end)
        if self._tool_started:
            call = {"id": None, "index": 0, "type": "function",
                    "function": {"name": None, "arguments": args}}  # fmt: skip
        else:
            self._tool_started = True
            call = {"id": self.job.tool_id, "index": 0, "type": "function",
                    "function": {"name": self.job.tool_name, "arguments": args}}  # fmt: skip
        delta = '{"role":null,"content":null,"reasoning_content":null,"tool_calls":' + compact([call]) + "}"
        return (self._head + delta + self._tail[:-3] + ',"usage":null}\n\n').encode()

    # With `n > 1` the finish chunks of every choice come after the last output, all with the
    # id of the choice that finished last (serving_chat.py:2640).
    finish_after_all = True

    def end(self, engine_reason: str) -> list[bytes]:
        return self.finish(engine_reason) + self._usage_and_done()

    def finish(self, engine_reason: str) -> list[bytes]:
        reason = self.job.finish_reason(engine_reason)
        stop = compact(matched_stop(reason))
        finish = f',"logprobs":null,"finish_reason":"{reason}","matched_stop":{stop}}}]}}\n\n'
        return [(self._head + '{"reasoning_content":null}' + finish).encode()]

    def _usage_and_done(self) -> list[bytes]:
        if not self.job.include_usage:
            return [DONE]
        return [self.usage(self.reported_prompt_tokens, self.generated, self.reasoning_generated), DONE]

    def usage(self, prompt: int, completion: int, reasoning: int) -> bytes:
        return (self._usage_head + compact(chat_usage(prompt, completion, reasoning)) + "}\n\n").encode()

    def abort(self, status: int, message: str) -> list[bytes]:
        """serving_chat.py:2562-2578: the error chunk, then (as after any end) the usage chunk
        if asked and [DONE]; HTTP status stays 200."""
        return [streaming_error_event(status, message)] + self._usage_and_done()


class CompletionRenderer(ChoicesRenderer):
    """``/v1/completions`` chunks: text chunks, the finish reason in the last one, usage."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        head = _chunk_head(job, "text_completion")
        self._head = head + f'[{{"index":{job.index},"text":"'
        self._usage_head = head + '[],"usage":'
        self._open_tail = '","logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
        self._pending: list[str] = []

    def output(self, output: Output) -> list[bytes]:
        self.generated += output.tokens
        text = "".join(text for _, text in self.cursor.take(output.tokens))
        if output.finish_reason is not None:
            self._pending.append(text)  # goes out with the finish reason in end()
            return []
        return [self._chunk(text, None)]

    def _chunk(self, text: str, reason: str | None) -> bytes:
        if reason is None:  # every chunk but the last: the tail is always the same
            return (self._head + text + self._open_tail).encode()
        stop = compact(matched_stop(reason))
        tail = f'","logprobs":null,"finish_reason":"{reason}","matched_stop":{stop}}}]}}\n\n'
        return (self._head + text + tail).encode()

    finish_after_all = False  # the finish reason rides in each choice's last chunk

    def end(self, engine_reason: str) -> list[bytes]:
        return self.finish(engine_reason) + self._usage_and_done()

    def finish(self, engine_reason: str) -> list[bytes]:
        return [self._chunk("".join(self._pending), self.job.finish_reason(engine_reason))]

    def _usage_and_done(self) -> list[bytes]:
        if not self.job.include_usage:
            return [DONE]
        return [self.usage(self.reported_prompt_tokens, self.generated, 0), DONE]

    def usage(self, prompt: int, completion: int, reasoning: int) -> bytes:
        """serving_completions.py:495: exclude_none, so no nulls."""
        usage = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                 "completion_tokens": completion, "reasoning_tokens": reasoning}  # fmt: skip
        return (self._usage_head + compact(usage) + "}\n\n").encode()

    def abort(self, status: int, message: str) -> list[bytes]:
        """serving_completions.py:362-372, then usage and [DONE] as after any end."""
        return [streaming_error_event(status, message)] + self._usage_and_done()


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {compact(data)}\n\n".encode()


class MessagesRenderer(Renderer):
    """Anthropic ``/v1/messages`` events, as entrypoints/anthropic/serving.py:862 makes them
    from the chat stream: message_start deferred to the first content (it carries the prompt
    tokens), one block per kind (thinking, text, tool_use), message_delta and message_stop;
    an error is ``event: error`` then message_stop, never [DONE]."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._message_id = f"msg_{uuid.uuid4().hex}"  # serving.py:881, not the rid
        self._started = False
        self._block: str | None = None
        self._index = 0

    def _event(self, data: dict[str, Any]) -> bytes:
        return sse_event(data["type"], data)

    def _message_start(self, input_tokens: int) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        message = {"id": self._message_id, "type": "message", "role": "assistant", "content": [],
                   "model": self.job.model,
                   "usage": {"input_tokens": input_tokens, "output_tokens": 0}}  # fmt: skip
        return [self._event({"type": "message_start", "message": message})]

    def _close_block(self) -> list[bytes]:
        if self._block is None:
            return []
        self._block = None
        self._index += 1
        return [self._event({"type": "content_block_stop", "index": self._index - 1})]

    def _open_block(self, kind: str, block: dict[str, Any], force_new: bool = False) -> list[bytes]:
        events = []
        if self._block is not None and (force_new or self._block != kind):
            events += self._close_block()
        if self._block is None:
            self._block = kind
            events.append(self._event({"type": "content_block_start", "index": self._index,
                                       "content_block": block}))  # fmt: skip
        return events

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self._event({"type": "content_block_delta", "index": self._index, "delta": delta})

    def _segment(self, kind: str, text: str) -> list[bytes]:
        # Continuous usage stats (serving.py:570) put the prompt tokens on every content chunk.
        events = self._message_start(self.job.prompt_tokens)
        if kind == "reasoning":
            events += self._open_block("thinking", {"type": "thinking", "thinking": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        elif self.job.tool_name is None:
            events += self._open_block("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": text}))
        else:
            first = self._block != "tool_use"
            if first:
                block = {"type": "tool_use", "id": self.job.tool_id, "name": self.job.tool_name,
                         "input": {}}  # fmt: skip
                events += self._open_block("tool_use", block, force_new=True)
            args = tool_arguments(text, first, self.cursor.at_end)
            events.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return events

    def end(self, engine_reason: str) -> list[bytes]:
        stop = ANTHROPIC_STOP.get(self.job.finish_reason(engine_reason), "end_turn")
        events = self._message_start(0) + self._close_block()
        events.append(self._event({"type": "message_delta", "delta": {"stop_reason": stop},
                                   "usage": {"output_tokens": self.generated}}))  # fmt: skip
        events.append(self._event({"type": "message_stop"}))
        return events

    def abort(self, status: int, message: str) -> list[bytes]:
        """serving.py:978 (_flush_on_error) on the chat stream's error chunk (serving.py:1120):
        the message is passed on unscrubbed."""
        events = self._message_start(0) + self._close_block()
        events.append(self._event(anthropic_error_body(status, message)))
        events.append(self._event({"type": "message_stop"}))
        return events


def anthropic_message(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """serving.py:1282 (_convert_response), dumped with exclude_none."""
    reasoning, content = split_answer(job.plan, generated)
    blocks: list[dict[str, Any]] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning})
    if job.tool_name is None:
        if content:
            blocks.append({"type": "text", "text": content})
    else:
        arguments = json.loads(tool_arguments(content, True, True))
        blocks.append({"type": "tool_use", "id": job.tool_id, "name": job.tool_name, "input": arguments})
    stop = ANTHROPIC_STOP.get(job.finish_reason(engine_reason), "end_turn")
    return {
        "id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
        "content": blocks or [{"type": "text", "text": ""}], "model": job.model,
        "stop_reason": stop, "usage": {"input_tokens": job.prompt_tokens, "output_tokens": generated},
    }  # fmt: skip


class ResponsesRenderer(Renderer):
    """OpenAI Responses events as serving_responses.py:2246 (non-harmony) makes them: created
    and in_progress, then one item per kind (reasoning, message, function_call) opened with
    output_item.added and closed with its done events, then response.completed / incomplete /
    failed carrying the whole response. Never [DONE]."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._sequence = 0
        self._kind: str | None = None  # the open item
        self._item_id = ""
        self._text: list[str] = []
        self.items: list[dict[str, Any]] = []  # closed items, the response's output
        self.final: dict[str, Any] | None = None  # the response, once finished

    def _event(self, data: dict[str, Any]) -> bytes:
        data["sequence_number"] = self._sequence
        self._sequence += 1
        return sse_event(data["type"], data)

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": len(self.items)}

    def begin(self) -> list[bytes]:
        self.begun = True
        response = responses_body(self.job, [], "in_progress", None)
        return [self._event({"type": "response.created", "response": response}),
                self._event({"type": "response.in_progress", "response": response})]  # fmt: skip

    def _segment(self, kind: str, text: str) -> list[bytes]:
        if kind == "content" and self.job.tool_name is not None:
            kind = "tool"
        events = [] if self._kind == kind else self._close() + self._open(kind)
        self._text.append(text)
        if kind == "reasoning":
            delta = {"type": "response.reasoning_text.delta", **self._at(), "content_index": 0,
                     "delta": text}  # fmt: skip
        elif kind == "content":
            delta = {"type": "response.output_text.delta", **self._at(), "content_index": 0,
                     "delta": text, "logprobs": []}  # fmt: skip
        else:
            args = tool_arguments(text, len(self._text) == 1, self.cursor.at_end)
            self._text[-1] = args
            delta = {"type": "response.function_call_arguments.delta", **self._at(), "delta": args}
        return events + [self._event(delta)]

    def _open(self, kind: str) -> list[bytes]:
        self._kind, self._text = kind, []
        index = len(self.items)
        if kind == "reasoning":
            self._item_id = f"rs_{uuid.uuid4().hex}"
            item = reasoning_item(self._item_id, "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "content":
            self._item_id = f"msg_{uuid.uuid4().hex}"
            item = message_item(self._item_id, None, "in_progress")
            part = output_text("")
        else:
            self._item_id = f"fc_{uuid.uuid4().hex[:8]}"
            item = function_call_item(self._item_id, self.job, "", "in_progress")
            return [self._event({"type": "response.output_item.added", "output_index": index, "item": item})]
        return [
            self._event({"type": "response.output_item.added", "output_index": index, "item": item}),
            self._event({"type": "response.content_part.added", **self._at(), "content_index": 0,
                         "part": part}),
        ]  # fmt: skip

    def _close(self) -> list[bytes]:
        kind, text = self._kind, "".join(self._text)
        if kind is None:
            return []
        self._kind = None
        at = self._at()
        if kind == "reasoning":
            item = reasoning_item(self._item_id, text, "completed")
            events = [
                self._event({"type": "response.reasoning_text.done", **at, "content_index": 0, "text": text}),
                self._event({"type": "response.content_part.done", **at, "content_index": 0,
                             "part": {"type": "reasoning_text", "text": text}}),
            ]  # fmt: skip
        elif kind == "content":
            item = message_item(self._item_id, text, "completed")
            events = [
                self._event({"type": "response.output_text.done", **at, "content_index": 0, "text": text,
                             "logprobs": []}),
                self._event({"type": "response.content_part.done", **at, "content_index": 0,
                             "part": output_text(text)}),
            ]  # fmt: skip
        else:
            item = function_call_item(self._item_id, self.job, text, "completed")
            events = [self._event({"type": "response.function_call_arguments.done", **at,
                                   "arguments": text, "name": self.job.tool_name})]  # fmt: skip
        events.append(self._event({"type": "response.output_item.done", "output_index": at["output_index"],
                                   "item": item}))  # fmt: skip
        self.items.append(item)
        return events

    def end(self, engine_reason: str) -> list[bytes]:
        status = responses_status(self.job.finish_reason(engine_reason))
        return self._finish(status, None)

    def abort(self, status: int, message: str) -> list[bytes]:
        """A status abort is a finish_reason "abort": response.failed (serving_responses.py:1062,
        :3050), after created/in_progress and the open item's done events."""
        return self._finish("failed", {"code": "server_error", "message": message})

    def _finish(self, status: str, error: dict[str, Any] | None) -> list[bytes]:
        events = ([] if self.begun else self.begin()) + self._close()
        prompt = self.reported_prompt_tokens
        tokens = (prompt, self.generated, self.reasoning_generated)
        self.final = responses_body(self.job, self.items, status, tokens, error)
        return events + [self._event({"type": f"response.{status}", "response": self.final})]


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": None}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "content": content, "role": "assistant", "status": status,
            "type": "message", "phase": "final_answer"}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "summary": [], "type": "reasoning", "content": content, "status": status}


def function_call_item(item_id: str, job: Job, arguments: str, status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": job.tool_id, "name": job.tool_name,
            "type": "function_call", "id": item_id, "status": status}  # fmt: skip


def responses_status(reason: str) -> str:
    """serving_responses.py:1062."""
    if reason == "length":
        return "incomplete"
    return "failed" if reason == "abort" else "completed"


def responses_body(job: Job, output: list[dict[str, Any]], status: str,
                   tokens: tuple[int, int, int] | None,
                   error: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """protocol.py:2238 (ResponsesResponse) as from_request (protocol.py:2305) fills it."""
    usage = None
    if tokens is not None:
        prompt, completion, reasoning = tokens
        usage = {"input_tokens": prompt,
                 "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                 "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": prompt + completion}  # fmt: skip
    echo = job.echo
    text_only = all(item["type"] == "message" for item in output)
    return {
        "id": job.rid, "object": "response", "created_at": job.created, "model": job.model,
        "output": output, "status": status, "usage": usage,
        "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []),
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None}, "store": echo.get("store", True),
        "temperature": echo.get("temperature"), "text": {"format": {"type": "text"}} if text_only else None,
        "top_p": echo.get("top_p"), "truncation": echo.get("truncation", "disabled"),
        "user": echo.get("user"), "metadata": echo.get("metadata") or {},
    }  # fmt: skip


# --- non-stream bodies ----------------------------------------------------------------------


def chat_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    reasoning, content = split_answer(job.plan, generated)
    reason = job.finish_reason(engine_reason)
    # serving_chat.py:2995: content is "" rather than null when there is no text.
    message: dict[str, Any] = {"role": "assistant", "content": content,
                               "reasoning_content": reasoning or None}  # fmt: skip
    if job.tool_name is not None:
        message["content"] = ""
        function = {"name": job.tool_name, "arguments": tool_arguments(content, True, True)}
        message["tool_calls"] = [{"id": job.tool_id, "index": 0, "type": "function", "function": function}]
    choice = {"index": job.index, "message": message, "logprobs": None, "finish_reason": reason,
              "matched_stop": matched_stop(reason)}  # fmt: skip
    reasoning_tokens = min(generated, job.plan.reasoning_tokens)
    return {
        "id": job.rid, "object": "chat.completion", "created": job.created, "model": job.model,
        "choices": [choice], "usage": chat_usage(job.prompt_tokens, generated, reasoning_tokens),
        "metadata": {"weight_version": "default"},
    }  # fmt: skip


def completion_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    reason = job.finish_reason(engine_reason)
    text = "".join(split_answer(job.plan, generated))
    choice = {"index": job.index, "text": text, "logprobs": None, "finish_reason": reason,
              "matched_stop": matched_stop(reason)}  # fmt: skip
    usage = chat_usage(job.prompt_tokens, generated, 0)
    return {
        "id": job.rid, "object": "text_completion", "created": job.created, "model": job.model,
        "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"},
    }  # fmt: skip


def responses_final_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """The non-stream response: the stream's items, rendered at once."""
    renderer = ResponsesRenderer(job)
    renderer.begun = True
    renderer.output(Output(job.rid, generated))
    renderer.end(engine_reason)
    assert renderer.final is not None  # end() always sets it
    return renderer.final


def new_rid() -> str:
    return uuid.uuid4().hex


# --- SGLang's native /generate ------------------------------------------------------------------

WORD_IDS = {word: 1000 + i for i, word in enumerate(WORDS)}  # stand-in token ids


class GenerateRenderer(Renderer):
    """``/generate`` stream chunks (http_server.py:950): ``data: {"text", "output_ids",
    "meta_info"}`` per engine output, text and ids cumulative (incremental_streaming_output is
    off by default), the finish reason as SGLang's to_json dicts, then ``data: [DONE]``."""

    def __init__(self, job: Job, draft_tokens: int = 0) -> None:
        super().__init__(job)
        self._draft_tokens = draft_tokens  # speculative_num_draft_tokens; 0 without speculation
        self._words: list[str] = []
        self._verify_ct = 0

    def output(self, output: Output) -> list[bytes]:
        self.generated += output.tokens
        self._verify_ct += 0 if output.first else 1
        for _, text in self.cursor.take(output.tokens):
            self._words.append(text)
        if output.finish_reason is not None:
            return []  # goes out with the finish reason in end()
        return [self._chunk(None)]

    def _chunk(self, finish: dict[str, Any] | None) -> bytes:
        return b"data: " + compact(generate_body_of(self.job, "".join(self._words), self.generated,
                                                    finish, self._spec())).encode() + b"\n\n"  # fmt: skip

    def _spec(self) -> dict[str, Any]:
        """tokenizer_manager.py:3149: per-request speculative figures."""
        if not self._draft_tokens or not self._verify_ct:
            return {}
        proposed = self._verify_ct * (self._draft_tokens - 1)
        correct = max(self.generated - 1 - self._verify_ct, 0)  # the prefill token is no draft
        return {"spec_accept_rate": correct / proposed,
                "spec_accept_length": self.generated / self._verify_ct,
                "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                "spec_verify_ct": self._verify_ct}  # fmt: skip

    def end(self, engine_reason: str) -> list[bytes]:
        return [self._chunk(generate_finish(self.job, engine_reason)), DONE]

    def abort(self, status: int, message: str) -> list[bytes]:
        """The abort output is an ordinary chunk whose finish_reason carries the status
        (tokenizer_manager.py:1891 yields it for a stream), then [DONE]."""
        finish = {"type": "abort", "status_code": status, "message": message}
        return [self._chunk(finish), DONE]

    def raised(self, message: str) -> list[bytes]:
        """http_server.py:960: the ValueError as an error event, then [DONE]."""
        error = {"message": message, "type": "invalid_request_error", "code": 400, "retryable": False}
        return [b"data: " + compact({"error": error}).encode() + b"\n\n", DONE]


def generate_finish(job: Job, engine_reason: str) -> dict[str, Any]:
    """schedule_batch.py FINISH_* to_json."""
    reason = job.finish_reason(engine_reason)
    if reason == "abort":
        return {"type": "abort", "message": None, "status_code": None, "err_type": None}
    if reason == "length":
        return {"type": "length", "length": len(job.plan.words)}
    return {"type": "stop", "matched": IM_END_TOKEN_ID}


def generate_body_of(job: Job, text: str, generated: int, finish: dict[str, Any] | None,
                     spec: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    meta = {"id": job.rid, "finish_reason": finish, "prompt_tokens": job.prompt_tokens,
            "weight_version": "default", "num_retractions": 0, "reasoning_tokens": 0,
            "completion_tokens": generated, "cached_tokens": 0, **spec}  # fmt: skip
    ids = [WORD_IDS.get(word, 0) for word in job.plan.words[:generated]]
    return {"text": text, "output_ids": ids, "meta_info": meta}


def generate_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    text = "".join(split_answer(job.plan, generated))
    return generate_body_of(job, text, generated, generate_finish(job, engine_reason), {})


def merge_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """An `n > 1` answer from each choice's own (serving_chat.py:3040): the first choice's id,
    every choice, the prompt counted once and the completions summed."""
    merged = dict(bodies[0])
    merged["choices"] = [body["choices"][0] for body in bodies]
    prompt = bodies[0]["usage"]["prompt_tokens"]
    completion = sum(body["usage"]["completion_tokens"] for body in bodies)
    reasoning = sum(body["usage"]["reasoning_tokens"] for body in bodies)
    merged["usage"] = chat_usage(prompt, completion, reasoning)
    return merged
