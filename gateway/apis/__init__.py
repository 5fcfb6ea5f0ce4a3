"""The three APIs the gateway speaks, by path. Each shapes its errors its own way, before and
inside a stream (errors.py, streams.py); everything else about a request is the same."""

from __future__ import annotations

OPENAI, ANTHROPIC, RESPONSES = "openai", "anthropic", "responses"
_APIS = {"/v1/messages": ANTHROPIC, "/v1/messages/count_tokens": ANTHROPIC,
         "/v1/responses": RESPONSES}


def api_of(path: str) -> str:
    return _APIS.get(path, OPENAI)
