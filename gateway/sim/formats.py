"""Wire formats: SGLang 0.5.23's OpenAI chunks, Anthropic Messages and OpenAI Responses events.

A renderer turns engine outputs into SSE events (bytes). Chunk bytes are assembled from
pre-built pieces, because 128 streams share two cores with the gateway and the load generator;
the text pieces are ASCII words (see text.WORDS), so they go into JSON strings unescaped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.sim.engine import Output
from gateway.sim.text import IM_END_TOKEN_ID, Plan, TextCursor, split_answer

DONE = b"data: [DONE]\n\n"


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

    def finish_reason(self, engine_reason: str) -> str:
        """Engine "length" means the plan ran out: a natural stop, the length limit or a tool call."""
        if engine_reason == "abort":
            return "abort"
        return "tool_calls" if self.tool_name else self.plan.finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def openai_error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def matched_stop(reason: str) -> int | None:
    return IM_END_TOKEN_ID if reason == "stop" else None


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
    """Events of one stream: ``begin`` before the first output, ``output`` per engine output,
    ``end`` after the last, ``error`` for SGLang's mid-stream error."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cursor = TextCursor(job.plan)
        self.generated = 0

    def begin(self) -> list[bytes]:
        return []

    def output(self, output: Output) -> list[bytes]:
        self.generated += output.tokens
        return [self._segment(kind, text) for kind, text in self.cursor.take(output.tokens)]

    def _segment(self, kind: str, text: str) -> bytes:
        raise NotImplementedError

    def end(self, engine_reason: str) -> list[bytes]:
        raise NotImplementedError

    def error(self, status: int, message: str) -> list[bytes]:
        body = {"error": openai_error_body(status, message, "InternalServerError")}
        return [f"data: {json.dumps(body)}\n\n".encode(), DONE]  # json.dumps with spaces, as SGLang

    @property
    def reasoning_generated(self) -> int:
        return min(self.generated, self.job.plan.reasoning_tokens)


def _chunk_head(job: Job, object_name: str) -> str:
    """`data: {"id":...,"object":...,"created":...,"model":...,"choices":` of every chunk."""
    return (f'data: {{"id":{json.dumps(job.rid)},"object":"{object_name}",'
            f'"created":{job.created},"model":{json.dumps(job.model)},"choices":')


class ChatRenderer(Renderer):
    """``/v1/chat/completions`` chunks: role, content (several tokens per MTP chunk), finish, usage."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        head = _chunk_head(job, "chat.completion.chunk")
        self._head = head + '[{"index":0,"delta":'
        self._usage_head = head + '[],"usage":'
        self._tail = ',"logprobs":null,"finish_reason":null,"matched_stop":null}]}\n\n'
        self._content_started = False

    def begin(self) -> list[bytes]:
        delta = '{"reasoning_content":null,"role":"assistant","content":""}'
        return [(self._head + delta + self._tail).encode()]

    def _segment(self, kind: str, text: str) -> bytes:
        if kind == "reasoning":
            return (self._head + '{"reasoning_content":"' + text + '"}' + self._tail).encode()
        if self.job.tool_name is None:
            delta = '{"reasoning_content":null,"content":"' + text + '"}'
        else:
            delta = '{"reasoning_content":null,"tool_calls":' + compact([self._tool_delta(text)]) + "}"
        return (self._head + delta + self._tail).encode()

    def _tool_delta(self, text: str) -> dict[str, Any]:
        args = tool_arguments(text, not self._content_started, self.cursor.at_end)
        if self._content_started:
            return {"index": 0, "function": {"arguments": args}}
        self._content_started = True
        function = {"name": self.job.tool_name, "arguments": args}
        return {"index": 0, "id": f"call_{self.job.rid[:24]}", "type": "function", "function": function}

    def end(self, engine_reason: str) -> list[bytes]:
        reason = self.job.finish_reason(engine_reason)
        stop = compact(matched_stop(reason))
        finish = f',"logprobs":null,"finish_reason":"{reason}","matched_stop":{stop}}}]}}\n\n'
        events = [(self._head + '{"reasoning_content":null}' + finish).encode()]
        if self.job.include_usage:
            usage = chat_usage(self.job.prompt_tokens, self.generated, self.reasoning_generated)
            events.append((self._usage_head + compact(usage) + "}\n\n").encode())
        events.append(DONE)
        return events


class CompletionRenderer(Renderer):
    """``/v1/completions`` chunks: text chunks, the finish reason in the last one, usage."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        head = _chunk_head(job, "text_completion")
        self._head = head + '[{"index":0,"text":"'
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

    def end(self, engine_reason: str) -> list[bytes]:
        events = [self._chunk("".join(self._pending), self.job.finish_reason(engine_reason))]
        if self.job.include_usage:
            prompt = self.job.prompt_tokens
            usage = {"prompt_tokens": prompt, "total_tokens": prompt + self.generated,
                     "completion_tokens": self.generated, "reasoning_tokens": 0}  # fmt: skip
            events.append((self._usage_head + compact(usage) + "}\n\n").encode())
        events.append(DONE)
        return events


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {compact(data)}\n\n".encode()


ANTHROPIC_STOP = {"stop": "end_turn", "length": "max_tokens", "abort": "end_turn"}


class MessagesRenderer(Renderer):
    """Anthropic ``/v1/messages`` events: message_start, one text block, message_delta/stop."""

    def begin(self) -> list[bytes]:
        message = anthropic_message(self.job, "", None, 0)
        block = {"type": "text", "text": ""}
        return [
            sse_event("message_start", {"type": "message_start", "message": message}),
            sse_event("content_block_start",
                      {"type": "content_block_start", "index": 0, "content_block": block}),
        ]  # fmt: skip

    def _segment(self, kind: str, text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})

    def end(self, engine_reason: str) -> list[bytes]:
        stop = ANTHROPIC_STOP[self.job.finish_reason(engine_reason)]
        delta = {"stop_reason": stop, "stop_sequence": None}
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
            sse_event("message_delta", {"type": "message_delta", "delta": delta,
                                        "usage": {"output_tokens": self.generated}}),
            sse_event("message_stop", {"type": "message_stop"}),
        ]  # fmt: skip

    def error(self, status: int, message: str) -> list[bytes]:
        return [sse_event("error", {"type": "error", "error": {"type": "api_error", "message": message}})]


def anthropic_message(job: Job, text: str, stop_reason: str | None, output_tokens: int) -> dict[str, Any]:
    content = [{"type": "text", "text": text}] if stop_reason else []
    return {
        "id": f"msg_{job.rid}", "type": "message", "role": "assistant", "model": job.model,
        "content": content, "stop_reason": stop_reason, "stop_sequence": None,
        "usage": {"input_tokens": job.prompt_tokens, "output_tokens": output_tokens},
    }  # fmt: skip


class ResponsesRenderer(Renderer):
    """OpenAI Responses events for one text message, each with a ``sequence_number``."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._sequence = 0
        self._item_id = f"msg_{job.rid}"
        self._text: list[str] = []

    def _event(self, event: str, **fields: Any) -> bytes:
        data = {"type": event, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse_event(event, data)

    def begin(self) -> list[bytes]:
        response = responses_body(self.job, None, "in_progress", 0)
        item = {"type": "message", "id": self._item_id, "status": "in_progress", "role": "assistant",
                "content": []}  # fmt: skip
        at = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **at, part=output_text("")),
        ]

    def _segment(self, kind: str, text: str) -> bytes:
        self._text.append(text)
        at = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return self._event("response.output_text.delta", **at, delta=text, logprobs=[])

    def end(self, engine_reason: str) -> list[bytes]:
        text = "".join(self._text)
        reason = self.job.finish_reason(engine_reason)
        response = responses_body(self.job, text, responses_status(reason), self.generated)
        at = {"item_id": self._item_id, "output_index": 0, "content_index": 0}
        return [
            self._event("response.output_text.done", **at, text=text, logprobs=[]),
            self._event("response.content_part.done", **at, part=output_text(text)),
            self._event("response.output_item.done", output_index=0, item=response["output"][0]),
            self._event("response.completed", response=response),
        ]

    def error(self, status: int, message: str) -> list[bytes]:
        return [self._event("error", code=str(status), message=message, param=None)]


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def responses_status(reason: str) -> str:
    return "completed" if reason == "stop" else "incomplete"


def responses_body(job: Job, text: str | None, status: str, output_tokens: int) -> dict[str, Any]:
    output = []
    if text is not None:
        output.append({"type": "message", "id": f"msg_{job.rid}", "status": "completed",
                       "role": "assistant", "content": [output_text(text)]})  # fmt: skip
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": f"resp_{job.rid}", "object": "response", "created_at": job.created, "status": status,
        "model": job.model, "output": output, "incomplete_details": incomplete,
        "usage": {"input_tokens": job.prompt_tokens, "output_tokens": output_tokens,
                  "total_tokens": job.prompt_tokens + output_tokens},
    }  # fmt: skip


# --- non-stream bodies ----------------------------------------------------------------------


def chat_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    reasoning, content = split_answer(job.plan, generated)
    reason = job.finish_reason(engine_reason)
    message: dict[str, Any] = {"role": "assistant", "content": content or None,
                               "reasoning_content": reasoning or None}  # fmt: skip
    if job.tool_name is not None:
        message["content"] = None
        function = {"name": job.tool_name, "arguments": tool_arguments(content, True, True)}
        message["tool_calls"] = [{"id": f"call_{job.rid[:24]}", "index": 0, "type": "function",
                                  "function": function}]  # fmt: skip
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason,
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
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
              "matched_stop": matched_stop(reason)}  # fmt: skip
    usage = chat_usage(job.prompt_tokens, generated, 0)
    return {
        "id": job.rid, "object": "text_completion", "created": job.created, "model": job.model,
        "choices": [choice], "usage": usage, "metadata": {"weight_version": "default"},
    }  # fmt: skip


def messages_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    stop = ANTHROPIC_STOP[job.finish_reason(engine_reason)]
    return anthropic_message(job, "".join(split_answer(job.plan, generated)), stop, generated)


def responses_final_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    status = responses_status(job.finish_reason(engine_reason))
    return responses_body(job, "".join(split_answer(job.plan, generated)), status, generated)


def new_rid() -> str:
    return uuid.uuid4().hex
