"""Reading request bodies as SGLang 0.5.23's pydantic models and converters do (no stricter,
no kinder): the stream flag, token limits, which tool a request makes the model call, thinking.

Everything here is pure: a body in, a value or a RequestError out.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

# pydantic's lax bool (what `stream: bool` accepts): these strings, any case, and 0/1.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class RequestError(Exception):
    """A request SGLang refuses before generating: status, message, error type and param."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.err_type, self.param = status, err_type, param


async def read_json(request: Request, require_json_type: bool = True) -> dict[str, Any]:
    """The JSON object body; SGLang insists on the content type where the route depends on
    validate_json_request (http_server.py:687; /generate does not)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if require_json_type and media_type != "application/json":
        message = "Unsupported Media Type: Only 'application/json' is allowed"
        raise RequestError(message, err_type="Bad Request")
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise RequestError(f"JSON decode error: {exc}", err_type="Bad Request") from exc
    if not isinstance(body, dict):
        raise RequestError("The request body must be a JSON object", err_type="Bad Request")
    return body


def stream_flag(body: Mapping[str, Any], optional: bool) -> bool:
    """``stream`` as pydantic reads a bool: "true"/"1"/1 are true. Chat and completions declare
    ``stream: bool`` (null refused); Messages and Responses ``Optional[bool]``."""
    value = body.get("stream", False)
    if value is None and optional:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise RequestError("stream: Input should be a valid boolean", err_type="Bad Request", param="stream")


def max_tokens_of(body: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = body.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise RequestError(f"'{key}' must be a positive integer", err_type="Bad Request")
        return value
    return None


def choices_of(body: Mapping[str, Any]) -> int:
    """``n`` (chat and completions: ``n: int = 1``, read as pydantic's lax int: 2, 2.0, "2")."""
    n = body.get("n", 1)
    if isinstance(n, str) and n.strip().isdigit():
        n = int(n)
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if type(n) is not int or n < 1:
        raise RequestError("n: Input should be a positive integer", err_type="Bad Request", param="n")
    return n


# --- which tool the model calls ---------------------------------------------------------------
# The simulated model calls a tool when the request forces one, or, with tool_choice "auto",
# when the conversation ends with the user speaking (not with a tool result): so an agent's
# loop runs user -> tool call -> tool result -> text answer.


def chosen_tool(tools: Any, tool_choice: Any, user_spoke_last: bool) -> str | None:
    """Chat tools ``[{"type": "function", "function": {"name": ...}}]``."""
    if not isinstance(tools, list) or not tools:
        return None
    names = [str(_function_of(tool).get("name") or "tool") for tool in tools]
    if isinstance(tool_choice, dict):
        return str(_function_of(tool_choice).get("name") or "") or None
    if tool_choice == "required" or (tool_choice in (None, "auto") and user_spoke_last):
        return names[0]
    return None


def _function_of(entry: Any) -> dict[str, Any]:
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict):
        raise ValueError("a tool needs a 'function' object")
    return function


def anthropic_tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools (with an input_schema); server tools (web_search_*, bash_*, ...) are
    skipped, as anthropic/serving.py:657 does."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ValueError("tools: Input should be a valid list")
    custom = []
    for tool in tools:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ValueError("tools: each tool needs a 'name'")
        if "input_schema" in tool:
            custom.append(tool)
    return custom


def anthropic_chosen_tool(tools: list[dict[str, Any]], tool_choice: Any, user_spoke_last: bool) -> str | None:
    """anthropic/serving.py:689: any -> required, tool -> that function (400 when unknown),
    none -> no tool; any/tool without a custom tool is a 400."""
    kind = "auto"
    if tool_choice is not None:
        kinds = ("auto", "any", "tool", "none")
        if not isinstance(tool_choice, dict) or tool_choice.get("type") not in kinds:
            raise ValueError("tool_choice: type must be one of 'auto', 'any', 'tool', 'none'")
        kind = tool_choice["type"]
    names = [tool["name"] for tool in tools]
    if kind == "none":
        return None
    if not names:
        if kind in ("any", "tool"):
            raise ValueError(f"tool_choice={kind!r} requires at least one custom tool; all supplied "
                             "tools were server-side Anthropic built-ins which the OpenAI-compatible "
                             "backend cannot invoke")  # fmt: skip
        return None
    if kind == "tool":
        name = tool_choice.get("name")
        if name not in names:
            raise ValueError(f"tool_choice references tool {name!r} but it is not in the forwarded "
                             "tools list (server-side Anthropic tools cannot be selected)")  # fmt: skip
        return str(name)
    return names[0] if kind == "any" or user_spoke_last else None


def anthropic_thinking(thinking: Any) -> bool:
    """Any thinking type but "disabled" turns reasoning on (anthropic/serving.py:600)."""
    if thinking is None:
        return False
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise ValueError("thinking: type must be one of 'enabled', 'disabled', 'adaptive'")
    kind: str = thinking["type"]  # one of the three strings just checked
    return kind != "disabled"


class ToolChoiceError(ValueError):
    param = "tool_choice"


def responses_chosen_tool(tools: Any, tool_choice: Any, given: Any) -> str | None:
    """Responses function tools ``[{"type": "function", "name": ...}]``; the checks of
    serving_responses.py:350-367."""
    if not isinstance(tools, list):
        raise ValueError("tools: Input should be a valid list")
    callable_tools = [t for t in tools if isinstance(t, dict) and t.get("type") in ("function", "custom")]
    names = [str(t.get("name")) for t in callable_tools]
    if tool_choice == "required" and not names:
        raise ValueError('tool_choice="required" requires at least one tool with type="function" or '
                         'type="custom"; other built-in tool types cannot be forced.')  # fmt: skip
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name")
        if name not in names:
            raise ToolChoiceError(f"Tool {name!r} is not declared in tools")
        return str(name)
    if not names or tool_choice == "none":
        return None
    user_spoke_last = isinstance(given, str) or _last_item_is_user(given)
    return names[0] if tool_choice == "required" or user_spoke_last else None


def _last_item_is_user(items: Any) -> bool:
    if not isinstance(items, list) or not items or not isinstance(items[-1], dict):
        return False
    return items[-1].get("role") == "user"


def last_is_user(messages: Any) -> bool:
    """The conversation ends with the user speaking, not with a tool result (an OpenAI
    ``tool`` message or an Anthropic user turn made of ``tool_result`` blocks)."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return False
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        if any(isinstance(part, dict) and part.get("type") == "tool_result" for part in content):
            return False
    return last.get("role") == "user"
