"""The paths the gateway relays and the API each one speaks: the one table of both.

Three APIs, told apart by how they shape their errors, before and inside a stream
(apis/errors.py, apis/streams.py); everything else about a request is the same. SGLang 0.5.23
serves these paths (http_server.py); the field is the one its request model requires, checked
before a request is sent (None: only "a JSON object")."""

from __future__ import annotations

# The APIs, by the shape of their errors and streams.
OPENAI_API, ANTHROPIC_API, RESPONSES_API = "openai", "anthropic", "responses"

# The paths whose streams the gateway can continue on another server (gateway/continuation).
CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"

# Every path the gateway relays to a backend: (its API, the field SGLang requires there).
_RELAYED: dict[str, tuple[str, str | None]] = {
    CHAT: (OPENAI_API, "messages"),
    COMPLETIONS: (OPENAI_API, "prompt"),
    MESSAGES: (ANTHROPIC_API, "messages"),
    "/v1/messages/count_tokens": (ANTHROPIC_API, "messages"),
    RESPONSES: (RESPONSES_API, "input"),
    "/v1/embeddings": (OPENAI_API, "input"),
    "/v1/rerank": (OPENAI_API, None),
    "/v1/score": (OPENAI_API, None),
    "/v1/classify": (OPENAI_API, None),
    "/v1/tokenize": (OPENAI_API, None),
    "/v1/detokenize": (OPENAI_API, None),
    GENERATE: (OPENAI_API, None),  # SGLang's native API: text, input_ids or input_embeds
}
# Paths the gateway proxies, and the field each one needs (None: only "a JSON object").
PROXY_PATHS: dict[str, str | None] = {path: field for path, (_, field) in _RELAYED.items()}
# Paths SGLang also serves on PUT (http_server.py:928, :2101): the same handler as POST.
PUT_PATHS = frozenset({GENERATE, "/v1/rerank"})
_APIS = {path: api for path, (api, _) in _RELAYED.items() if api != OPENAI_API}


def api_of(path: str) -> str:
    """The API a path speaks; every path not relayed (the gateway's own, /v1/models) is OpenAI's."""
    return _APIS.get(path, OPENAI_API)
