"""What every splicer shares (gateway/continuation/splice.py picks one per stream): the seam,
where the continuation joins the stream the client has; the usage that counts the whole
answer as SGLang would have for one request (the original request's prompt tokens: the
continuation's less the prefix it carried, `tokens_before`; the completion tokens of both
parts); and the base of the splicers that translate a chat continuation to another API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.continuation.events import parsed
from gateway.continuation.transcript import Relayed


@dataclass(frozen=True)
class Seam:
    """Where the continuation joins the stream the client has."""

    relayed: Relayed  # the client's stream so far
    tokens_before: int  # tokens of the answer so far: the prefix the continuation carries
    include_usage: bool = False  # the client asked for the usage chunk (chat, completions)


class Splicer:
    """Continuation events in, the client's events out."""

    def __init__(self, seam: Seam) -> None:
        self.seam = seam

    def feed(self, events: bytes) -> bytes:
        out = [self.event(name, data, value) for name, data, value in parsed(events)]
        return b"".join(out)

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        raise NotImplementedError

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A chat/completions usage object counting the whole answer."""
        before = self.seam.tokens_before
        prompt = max(int(usage.get("prompt_tokens") or 0) - before, 0)
        completion = int(usage.get("completion_tokens") or 0) + before
        fixed = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            fixed["prompt_tokens_details"] = {**details,
                                              "cached_tokens": min(details["cached_tokens"], prompt)}
        return fixed


class FromChat(Splicer):
    """A chat continuation translated to the client's API: [DONE] ends it, an error event
    ends it in the client's shape, every chunk's usage is kept to count the whole answer."""

    def __init__(self, seam: Seam) -> None:
        super().__init__(seam)
        self.finish: str | None = None
        self.usage_seen: dict[str, Any] | None = None

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            return self._end()
        if not isinstance(value, dict):
            return b""
        if "error" in value and "choices" not in value:
            error = value["error"] if isinstance(value["error"], dict) else {}
            return self._error(error.get("code"), str(error.get("message") or "Upstream error"))
        if isinstance(value.get("usage"), dict):
            self.usage_seen = value["usage"]
        out: list[bytes] = []
        for choice in value.get("choices") or ():
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
            out += self._choice(choice.get("delta") or {})
        return b"".join(out)

    def _choice(self, delta: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def _end(self) -> bytes:
        raise NotImplementedError

    def _error(self, code: Any, message: str) -> bytes:
        raise NotImplementedError
