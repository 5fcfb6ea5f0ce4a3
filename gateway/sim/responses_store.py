"""The stored responses of one simulated server (SGLang's ``--enable-response-store``).

SGLang keeps them in the memory of the server that answered (serving_responses.py:229,
``response_store`` and ``msg_store``), so a ``previous_response_id``, ``GET /v1/responses/{id}``
or a cancel sent to the other server finds nothing (404).
"""

from __future__ import annotations

from typing import Any

from gateway.sim import formats
from gateway.sim.requests import RequestError

STORE_DISABLED = ("Response store is disabled. Stateful Responses require --enable-response-store "
                  "on a standalone server; response storage is unavailable in PD mode.")  # fmt: skip


class ResponsesStore:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bodies: dict[str, dict[str, Any]] = {}
        self._history: dict[str, str] = {}  # the conversation so far, as prompt text

    def put(self, job: formats.Job, body: dict[str, Any]) -> None:
        stored = self._bodies.get(job.rid)
        if stored is not None and stored["status"] == "cancelled":
            return  # serving_responses.py:3043: a cancelled response stays cancelled
        self._bodies[job.rid] = body
        self._history[job.rid] = job.prompt_text + " " + output_text(body)

    def get(self, response_id: str, param: str = "response_id") -> dict[str, Any]:
        """serving_responses.py:1889: disabled -> 400, not resp_... -> 400, unknown -> 404."""
        if not self.enabled:
            raise RequestError(STORE_DISABLED, err_type="invalid_request_error", param=param)
        if not response_id.startswith("resp_"):
            message = f"Invalid 'response_id': '{response_id}'. Expected an ID that begins with 'resp'."
            raise RequestError(message, err_type="invalid_request_error", param="response_id")
        body = self._bodies.get(response_id)
        if body is None:
            raise RequestError(f"Response with id '{response_id}' not found.", 404,
                               "invalid_request_error", "response_id")  # fmt: skip
        return body

    def history(self, response_id: str) -> str:
        self.get(response_id, "previous_response_id")
        return self._history[response_id]

    def cancel(self, response_id: str) -> tuple[dict[str, Any], bool]:
        """(the response, whether it was still running and must be aborted). A finished one
        comes back as it is (serving_responses.py:1922)."""
        body = self.get(response_id)
        if body["status"] not in ("queued", "in_progress"):
            return body, False
        body["status"] = "cancelled"
        return body, True


def output_text(body: dict[str, Any]) -> str:
    texts = []
    for item in body.get("output", []):
        if item.get("type") == "function_call":
            texts.append(item.get("arguments", ""))
        for part in item.get("content", []):
            texts.append(part.get("text", ""))
    return " ".join(texts)
