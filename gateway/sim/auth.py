"""``--api-key`` and ``--admin-api-key`` as SGLang checks them (utils/auth.py)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.sim.replies import json_response

OPEN_PATHS = ("/health", "/ready", "/metrics")  # never need the API key, as in SGLang
# AuthLevel.ADMIN_OPTIONAL, of the routes the simulator has: /abort_request (http_server.py:1722)
# and the memory saver's four (:1576, :1588, :1832, :1845).
ADMIN_OPTIONAL_PATHS = frozenset({"/abort_request", "/pause_generation", "/continue_generation",
                                  "/release_memory_occupation", "/resume_memory_occupation"})  # fmt: skip


class ApiKeyMiddleware:
    """``--api-key`` and ``--admin-api-key`` (utils/auth.py:decide_request_auth): health,
    readiness and metrics are open; /abort_request and the memory saver's endpoints
    (AuthLevel.ADMIN_OPTIONAL) take the admin key when one is set, else the API key, else nothing;
    every other route the API key when set. A refusal is 401 ``{"error": "Unauthorized"}``
    (pure ASGI, so client disconnects still reach the app)."""

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self._key = api_key.encode() if api_key else None
        self._admin_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PATHS):
            return True
        key = self._key
        if scope["path"] in ADMIN_OPTIONAL_PATHS and self._admin_key is not None:
            key = self._admin_key
        if key is None:
            return True
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, key)
