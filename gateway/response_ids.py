"""Which backend stored each Responses API response: SGLang keeps a response (for
previous_response_id, GET and cancel) only on the server that made it."""

from __future__ import annotations

from gateway.sessions import SessionMap

STORED_RESPONSES = 10_000  # response ids remembered for affinity, least recently used forgotten


class ResponseStore:
    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self._holders = SessionMap(capacity)

    def holder(self, response_id: str | None) -> str | None:
        """The backend that stored `response_id` (None: not known here)."""
        return self._holders.get(response_id)

    def remember(self, response_id: str | None, backend: str) -> None:
        self._holders.put(response_id, backend)
