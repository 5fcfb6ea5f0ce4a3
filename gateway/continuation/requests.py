"""The request that continues a stream on another server.

The original request, with the answer so far as a prefix the server does not generate again,
the token limits less what was generated, a new rid, streamed with usage (to count the whole
answer). Chat: the prefix as the final assistant message with ``continue_final_message``
(entrypoints/openai/protocol.py:1013, serving_chat.py:519-548). Completions and /generate: the
prompt followed by the text (or the ids followed by the output ids). Messages and Responses:
their request converted to chat as SGLang's adapters convert it (`convert.py`), continued as
chat, since neither adapter sets continue_final_message (a final assistant message would be
made a user message, serving_chat.py:546-548).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.apis import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from gateway.continuation.convert import Unconvertible, messages_as_chat, responses_as_chat
from gateway.continuation.events import dumps
from gateway.continuation.transcript import Relayed

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # sampling_params.py: max_new_tokens = 128


@dataclass(frozen=True)
class Continuation:
    """What to send the next server."""

    path: str
    body: bytes
    rid: str


def continuation(path: str, body: Mapping[str, Any], relayed: Relayed, tokens_before: int,
                 rid: str, prefix_ids: list[int] | None = None) -> Continuation:
    """The continuation of a stream of `path` whose client has `relayed`, `tokens_before`
    tokens of answer so far (the prefix's length as the next server counts it), under `rid`.
    `prefix_ids`: the text's token ids, needed only for a completions prompt of ids.
    Raises Unconvertible for a Messages/Responses request the conversion does not cover."""
    if path == GENERATE:
        return _generate(body, relayed, rid)
    if path == COMPLETIONS:
        request = _completion(body, relayed, tokens_before, prefix_ids)
    else:
        request = _chat(_AS_CHAT[path](body), relayed, tokens_before)
        path = CHAT
    request["rid"] = rid
    return Continuation(path, dumps(request).encode(), rid)


_AS_CHAT: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    CHAT: dict, MESSAGES: messages_as_chat, RESPONSES: responses_as_chat}


def _less(request: dict[str, Any], keys: tuple[str, ...], used: int, floor: int) -> None:
    for key in keys:
        value = request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            request[key] = max(value - used, floor)


def _streamed_with_usage(request: dict[str, Any]) -> None:
    options = request.get("stream_options")
    request["stream"] = True
    request["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                 "include_usage": True}


def _chat(chat: dict[str, Any], relayed: Relayed, tokens_before: int) -> dict[str, Any]:
    request = dict(chat)
    messages = list(request.get("messages") or [])
    last = messages[-1] if messages else None
    if (request.get("continue_final_message") and isinstance(last, dict)
            and last.get("role") == "assistant" and isinstance(last.get("content"), str)):
        messages[-1] = {**last, "content": last["content"] + relayed.text}  # the client's own prefill
    else:
        messages.append({"role": "assistant", "content": relayed.text})
    request["messages"] = messages
    request["continue_final_message"] = True
    # A limit already reached keeps one token: SGLang refuses max_tokens 0 (protocol.py).
    _less(request, ("max_completion_tokens", "max_tokens"), tokens_before, 1)
    _less(request, ("min_tokens",), tokens_before, 0)
    _streamed_with_usage(request)
    return request


def _completion(body: Mapping[str, Any], relayed: Relayed, tokens_before: int,
                prefix_ids: list[int] | None) -> dict[str, Any]:
    request = dict(body)
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        request["prompt"] = prompt + relayed.text
    elif isinstance(prompt, list) and prefix_ids is not None:
        request["prompt"] = list(prompt) + prefix_ids
    else:
        raise Unconvertible("a completions prompt of token ids needs the text's ids")
    _less(request, ("max_tokens",), tokens_before, 1)
    _less(request, ("min_tokens",), tokens_before, 0)
    _streamed_with_usage(request)
    return request


def _generate(body: Mapping[str, Any], relayed: Relayed, rid: str) -> Continuation:
    """The output ids are SGLang's own (exact); text prompts get the text."""
    request = dict(body)
    if isinstance(request.get("input_ids"), list):
        request["input_ids"] = list(request["input_ids"]) + relayed.output_ids
    else:
        request["text"] = str(request.get("text") or "") + relayed.text
    params = dict(request.get("sampling_params") or {})
    params.setdefault("max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS)
    used = relayed.completion_tokens or 0
    _less(params, ("max_new_tokens",), used, 1)
    _less(params, ("min_new_tokens",), used, 0)
    request.update(sampling_params=params, stream=True, rid=rid)
    return Continuation(GENERATE, dumps(request).encode(), rid)

