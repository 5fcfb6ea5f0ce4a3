"""vLLM 0.33.0's ``/v1/responses`` for a text model served without a reasoning or tool parser
(what the simulated pair serves): the response object as ``ResponsesResponse`` dumps it
(``model_dump(mode="json")``, every field, in field order), the stream's events as the
simple (non-Harmony) path makes them, and the refusals its handler makes before generating.
Paths are under ``vllm/entrypoints/openai/responses/``; docs/compat.md's vLLM section has the
row. The SGLang simulator's Responses (``gateway.sim.formats.ResponsesRenderer``) is another
engine's bytes and stays as it is.

Without a parser every output's text is content (serving.py:1262-1267), so a plan's reasoning
words come out as message text, as a model's raw ``<think>`` text would.
"""

from __future__ import annotations

from typing import Any

from gateway.sim.engine import Output
from gateway.sim.formats import Job, Renderer, compact
from gateway.sim.replies import SimulatedCrash
from gateway.sim.requests import RequestError
from gateway.sim.vllm.formats import random_uuid

# protocol.py:246-330 (ResponsesRequest): the defaults a response repeats when the request
# leaves a field out; the sampling ones are SamplingParams' (protocol.py:542-548, :587-611).
REQUEST_DEFAULTS: dict[str, Any] = {"parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
                                    "background": False, "service_tier": "auto", "truncation": "disabled",
                                    "temperature": 1.0, "top_p": 1.0, "presence_penalty": 0.0,
                                    "frequency_penalty": 0.0}  # fmt: skip
SAMPLING_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
# The request fields the response echoes as given (protocol.py:988-1031, from_request).
ECHOED = ("instructions", "metadata", "parallel_tool_calls", "tool_choice", "tools", "background",
          "max_tool_calls", "previous_response_id", "prompt", "prompt_cache_options", "prompt_cache_key",
          "prompt_cache_retention", "reasoning", "service_tier", "safety_identifier", "text", "truncation",
          "user", "temperature", "top_p", "presence_penalty", "frequency_penalty")  # fmt: skip
STORE_NEEDED_FOR_BACKGROUND = (
    "This vLLM engine does not support `store=True` and therefore does not support the background mode. "
    "To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when "
    "launching the vLLM server.")  # fmt: skip


def check_body(body: dict[str, Any]) -> None:
    """ResponsesRequest's validation of the fields the simulator reads (protocol.py:246-330),
    as FastAPI's RequestValidationError (the route's handler answers it, generation.py
    ``validation_error``): ``input`` is required, a string or a list; the sampling numbers are
    numbers (pydantic's lax mode takes a numeric string)."""
    given = body.get("input")
    if given is None:
        raise RequestError("input: Field required", err_type="Bad Request", param="input")
    if not isinstance(given, str | list):
        raise RequestError("input: Input should be a valid string", err_type="Bad Request", param="input")
    for key in SAMPLING_NUMBERS:
        value = body.get(key)
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            continue
        try:
            float(value)
        except (TypeError, ValueError):
            raise RequestError(f"{key}: Input should be a valid number", err_type="Bad Request",
                               param=key) from None


def refusal(body: dict[str, Any]) -> RequestError | None:
    """What serving.py:335-371 refuses after the model check, with the response store off (the
    default, ``VLLM_ENABLE_RESPONSES_API_STORE`` unset): ``background`` with ``store`` (its
    default) is a 400 (serving.py:269-281); ``store`` alone is silently turned off
    (serving.py:355-363); any ``previous_response_id`` is looked up in the empty store and is a
    404 (serving.py:365-371, :1206-1212), whatever its prefix."""
    if body.get("background") and body.get("store", True):
        return RequestError(STORE_NEEDED_FOR_BACKGROUND, 400, "invalid_request_error", "background")
    previous = body.get("previous_response_id")
    if previous is not None:
        return RequestError(f"Response with id '{previous}' not found.", 404, "invalid_request_error",
                            "response_id")  # fmt: skip
    return None


def effective_echo(body: dict[str, Any], max_output_tokens: int) -> dict[str, Any]:
    """The request's fields as the response repeats them, ``max_output_tokens`` the sampling
    params' (``min(asked, max_model_len - prompt)``, serving.py:429-439, protocol.py:581-584)."""
    echo = {key: body.get(key) for key in ECHOED}
    for key, default in REQUEST_DEFAULTS.items():
        if echo[key] is None:
            echo[key] = default
    for key in SAMPLING_NUMBERS:
        echo[key] = float(echo[key] or 0)  # the response's fields are floats
    echo["max_output_tokens"] = max_output_tokens
    include = body.get("include") or []
    # SamplingParams.logprobs: top_logprobs only when output logprobs are included (protocol.py:635)
    echo["top_logprobs"] = body.get("top_logprobs", 0) if "message.output_text.logprobs" in include else None
    return echo


def item_status(reason: str) -> str:
    """utils.py:103-107 (response_item_status)."""
    return "incomplete" if reason == "length" else "completed"


def usage(prompt: int, output: int) -> dict[str, Any]:
    """ResponseUsage (protocol.py:98-117) as serving.py:892-921 fills it for SimpleContext: no
    per-turn metrics (context.py:208-209), nothing cached or reasoned counted."""
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0, "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + output}  # fmt: skip


def response_object(job: Job, output: list[dict[str, Any]], status: str,
                    tokens: tuple[int, int] | None) -> dict[str, Any]:  # fmt: skip
    """ResponsesResponse (protocol.py:870-951) as from_request fills it (:966-1031), in field
    order; ``metrics`` is left out when None (:904-906)."""
    echo = job.echo
    return {
        "id": job.rid, "created_at": job.created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"], "metadata": echo["metadata"], "model": job.model,
        "object": "response", "output": output, "parallel_tool_calls": echo["parallel_tool_calls"],
        "temperature": echo["temperature"], "tool_choice": echo["tool_choice"], "tools": echo["tools"],
        "top_p": echo["top_p"], "background": echo["background"],
        "max_output_tokens": echo["max_output_tokens"], "max_tool_calls": echo["max_tool_calls"],
        "previous_response_id": echo["previous_response_id"], "prompt": echo["prompt"],
        "prompt_cache_options": echo["prompt_cache_options"], "prompt_cache_key": echo["prompt_cache_key"],
        "prompt_cache_retention": echo["prompt_cache_retention"], "reasoning": echo["reasoning"],
        "safety_identifier": echo["safety_identifier"], "service_tier": echo["service_tier"],
        "status": status, "text": echo["text"], "top_logprobs": echo["top_logprobs"],
        "truncation": echo["truncation"], "usage": None if tokens is None else usage(*tokens),
        "user": echo["user"], "presence_penalty": echo["presence_penalty"],
        "frequency_penalty": echo["frequency_penalty"], "kv_transfer_params": None,
        "ec_transfer_params": None, "input_messages": None, "output_messages": None,
    }  # fmt: skip


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    """The openai SDK's ResponseOutputText in its field order."""
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """The openai SDK's ResponseOutputMessage in its field order (``phase`` unset: null)."""
    return {"id": item_id, "content": content, "role": "assistant", "status": status, "type": "message",
            "phase": None}  # fmt: skip


def response_body(job: Job, generated: int, engine_reason: str) -> dict[str, Any]:
    """The non-stream response (serving.py:770-950): one message item built at once, its text
    part only when there is text (serving.py:1067-1085), status incomplete at the length limit."""
    reason = job.finish_reason(engine_reason)
    renderer = VllmResponsesRenderer(job)
    text = "".join(piece for _, piece in renderer.cursor.take(generated))
    item = message(f"msg_{random_uuid()}", [output_text(text, None)] if text else [], item_status(reason))
    status = "incomplete" if reason == "length" else "completed"
    return response_object(job, [item], status, (job.prompt_tokens, generated))


class VllmResponsesRenderer(Renderer):
    """The stream (serving.py:1343-1457, api_router.py:32-43): ``response.created`` and
    ``response.in_progress`` with the empty response, a message item opened at the first text
    (output_item.added, content_part.added), an ``output_text.delta`` per engine output, the item
    closed at the end (output_text.done, content_part.done, output_item.done;
    streaming_events.py:835-954), then ``response.completed`` or ``response.incomplete``. Each
    event is ``event: <type>`` then its pydantic dump (the openai SDK's field order, ``type``
    last), numbered from 0. Never ``[DONE]``."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._sequence = 0
        self._item_id: str | None = None  # the open message item
        self._text = ""
        self._items: list[dict[str, Any]] = []

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        """The event's fields in the openai SDK's order: its event models declare them
        alphabetically (the items inside keep their own order)."""
        data = dict(sorted({**fields, "sequence_number": self._sequence, "type": kind}.items()))
        self._sequence += 1
        return f"event: {kind}\ndata: {compact(data)}\n\n".encode()

    def begin(self) -> list[bytes]:
        self.begun = True
        response = response_object(self.job, [], "in_progress", None)
        return [self._event("response.created", {"response": response}),
                self._event("response.in_progress", {"response": response})]  # fmt: skip

    def output(self, output: Output) -> list[bytes]:
        self.generated += output.tokens
        delta = "".join(piece for _, piece in self.cursor.take(output.tokens))
        if not delta:  # an empty delta opens nothing (streaming_events.py:1290-1291)
            return []
        events = [] if self._item_id is not None else self._open()
        self._text += delta
        return events + [self._event("response.output_text.delta", {
            "content_index": 0, "delta": delta, "item_id": self._item_id, "logprobs": [],
            "output_index": len(self._items)})]  # fmt: skip

    def _open(self) -> list[bytes]:
        self._item_id = f"msg_{random_uuid()}"
        at = {"item_id": self._item_id, "output_index": len(self._items)}
        return [self._event("response.output_item.added", {
                    "item": message(self._item_id, [], "in_progress"), "output_index": len(self._items)}),
                self._event("response.content_part.added", {
                    "content_index": 0, **at, "part": output_text("", [])})]  # fmt: skip

    def _close(self, status: str) -> list[bytes]:
        if self._item_id is None:
            return []
        at = {"item_id": self._item_id, "output_index": len(self._items)}
        part = output_text(self._text, None)
        item = message(self._item_id, [part] if self._text else [], status)
        events = [self._event("response.output_text.done", {"content_index": 0, **at, "logprobs": [],
                                                             "text": self._text}),
                  self._event("response.content_part.done", {"content_index": 0, **at, "part": part}),
                  self._event("response.output_item.done", {"item": item, "output_index": len(self._items)})]
        self._items.append(item)
        self._item_id = None
        return events  # fmt: skip

    def end(self, engine_reason: str) -> list[bytes]:
        """The open item closes with utils.py:103's status; the terminal event carries the
        response built from the streamed items (serving.py:1430-1457, :866-870)."""
        reason = self.job.finish_reason(engine_reason)
        events = self._close(item_status(reason))
        status = "incomplete" if reason == "length" else "completed"
        final = response_object(self.job, self._items, status, (self.job.prompt_tokens, self.generated))
        return events + [self._event(f"response.{status}", {"response": final})]

    def abort(self, status: int, message: str) -> list[bytes]:
        """A GenerationError in the stream (serving.py:1405-1424): its ErrorResponse JSON is
        validated as a stream event, which none of StreamingResponsesResponse's members
        (protocol.py:1052-1077) accepts, so the generator raises and the connection drops
        with no terminal event."""
        raise SimulatedCrash


__all__ = ["VllmResponsesRenderer", "check_body", "effective_echo", "refusal", "response_body"]
