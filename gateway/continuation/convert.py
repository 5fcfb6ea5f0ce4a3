"""Messages and Responses requests as the chat requests SGLang's adapters make of them, for
the shapes a continuation covers; anything else raises Unconvertible (the stream is then not
continued: a prompt that differs from the original one would not continue the same answer).

Messages: entrypoints/anthropic/serving.py:218-737 (`_convert_to_chat_completion_request`).
Responses: entrypoints/openai/serving_responses.py:733-765 (`_make_request`) and
:1733-1788 (`_construct_input_messages`), plain text input and messages only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class Unconvertible(ValueError):
    """A request whose chat form the continuation does not build."""


def messages_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") != "disabled":
        raise Unconvertible("thinking is turned on through the server's reasoning settings")
    if body.get("output_config") is not None:
        raise Unconvertible("output_config")
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or ():
        messages += _anthropic_message(message)
    request: dict[str, Any] = {"messages": messages, "model": body.get("model"),
                               "max_tokens": body.get("max_tokens"), "stream": True,
                               "stream_options": {"include_usage": True,
                                                  "continuous_usage_stats": True}}
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            request[key] = body[key]
    if body.get("stop_sequences") is not None:
        request["stop"] = body["stop_sequences"]
    tools = [_anthropic_tool(tool) for tool in body.get("tools") or ()
             if isinstance(tool, Mapping) and "input_schema" in tool]  # server tools skipped
    if tools:
        request["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping):
        request["parallel_tool_calls"] = not choice.get("disable_parallel_tool_use", False)
        if choice.get("type") == "none":
            request["tool_choice"] = "none"
        elif tools and choice.get("type") == "auto":
            request["tool_choice"] = "auto"
        elif choice.get("type") != "auto":
            raise Unconvertible("a forced tool choice")
    elif tools:
        request["tool_choice"] = "auto"
    return request


def _system_text(system: Any) -> str:
    """serving.py:400-409: a string (when not blank), or the text blocks joined by newlines."""
    if isinstance(system, str):
        return system if system.strip() else ""
    if isinstance(system, list):
        return "\n".join(block["text"] for block in system
                         if isinstance(block, Mapping) and block.get("type") == "text"
                         and block.get("text"))
    return ""


def _anthropic_message(message: Any) -> list[dict[str, Any]]:
    """serving.py:440-566 for text, tool_use and tool_result blocks."""
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise Unconvertible("a message that is not a user or assistant turn")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise Unconvertible("a message content that is neither a string nor blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and block.get("text") is not None:
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            out += _flushed_user(parts)
            for text in _tool_result_texts(block.get("content")):
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or
                            block.get("id") or "", "content": text})
        else:
            raise Unconvertible(f"a {kind!r} block")
    chat: dict[str, Any] = {"role": role}
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 else parts
        out.append(chat)
    elif calls:
        out.append(chat)
    elif role == "assistant":
        out.append({"role": "assistant", "content": ""})
    return out


def _flushed_user(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not parts:
        return []
    message = {"role": "user", "content": parts[0]["text"] if len(parts) == 1 else list(parts)}
    parts.clear()
    return [message]


def _tool_result_texts(content: Any) -> list[Any]:
    """serving.py:287-356 for text items: one tool message of the texts."""
    if not isinstance(content, list):
        return [str(content) if content else ""]
    texts = []
    for item in content:
        if not isinstance(item, Mapping) or item.get("type") != "text":
            raise Unconvertible("a tool result that is not text")
        if item.get("text"):
            texts.append({"type": "text", "text": item["text"]})
    if not texts:
        return [""]
    return [texts[0]["text"]] if len(texts) == 1 else [texts]


def _anthropic_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.get("name"),
                                "description": tool.get("description") or "",
                                "parameters": tool.get("input_schema")}
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def responses_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    if body.get("tools"):
        raise Unconvertible("tools (SGLang renders them from its own template tools)")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            messages.append(_responses_message(item))
    else:
        raise Unconvertible("an input that is neither text nor items")
    for earlier, later in zip(messages, messages[1:], strict=False):
        if earlier["role"] == later["role"] == "assistant":
            raise Unconvertible("consecutive assistant items (SGLang merges them)")
    request: dict[str, Any] = {"messages": messages, "stream": True, "tool_choice": "none",
                               "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    if body.get("model") is not None:  # optional on Responses (protocol.py), a string on chat
        request["model"] = body["model"]
    if body.get("max_output_tokens") is not None:
        request["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "top_k", "stop", "chat_template_kwargs"):
        if body.get(key) is not None:
            request[key] = body[key]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        request["reasoning_effort"] = reasoning["effort"]
    return request


def _responses_message(item: Any) -> dict[str, Any]:
    """serving_responses.py:1555-1659 for messages of text."""
    if not isinstance(item, Mapping) or item.get("type") not in (None, "message") \
            or item.get("role") not in ("user", "assistant"):
        raise Unconvertible("an input item that is not a user or assistant message")
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("input_text", "output_text"):
                raise Unconvertible("a content part that is not text")
            parts.append({"type": "text", "text": part.get("text", "")})
        content = parts
    elif not isinstance(content, str):
        raise Unconvertible("a message content that is neither text nor parts")
    return {"role": item["role"], "content": content}
