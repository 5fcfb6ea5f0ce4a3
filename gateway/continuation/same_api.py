"""Chat, completions and /generate continued as themselves: the continuation's events under
the stream's first id, its text and counts going on from what the client has."""

from __future__ import annotations

from typing import Any

from gateway.continuation.events import DONE, data_event
from gateway.continuation.seam import Splicer


class ChatSplicer(Splicer):
    """Chat continued as chat: the continuation's role chunk dropped, its chunks under the
    first id and creation time, its usage counting the whole answer; the usage chunk kept only
    when the client asked for it (the continuation always asks, to count)."""

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            return DONE
        if not isinstance(value, dict) or "choices" not in value:
            return data_event(value) if value is not None else b"data: " + data + b"\n\n"
        choices = value.get("choices") or []
        if not choices and value.get("usage") and not self.seam.include_usage:
            return b""
        if any(_is_role_only(choice) for choice in choices):
            return b""
        relayed = self.seam.relayed
        value["id"] = relayed.id if relayed.id is not None else value.get("id")
        if relayed.created is not None:
            value["created"] = relayed.created
        if isinstance(value.get("usage"), dict):
            value["usage"] = self.usage(value["usage"])
        return data_event(value)


def _is_role_only(choice: Any) -> bool:
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return (isinstance(delta, dict) and delta.get("role") == "assistant"
            and not delta.get("content") and not delta.get("reasoning_content")
            and not delta.get("tool_calls") and choice.get("finish_reason") is None)


class CompletionSplicer(ChatSplicer):
    """Completions continued as completions: no role chunk; the same id, usage, [DONE]."""


class GenerateSplicer(Splicer):
    """/generate continued as /generate: text and output ids cumulative over both parts,
    meta_info under the first id with the original prompt's tokens and the completion tokens
    of both parts."""

    def event(self, name: str | None, data: bytes, value: Any) -> bytes:
        if data == b"[DONE]":
            return DONE
        if not isinstance(value, dict) or "meta_info" not in value:
            return data_event(value) if value is not None else b"data: " + data + b"\n\n"
        relayed, before = self.seam.relayed, self.seam.tokens_before
        meta = dict(value["meta_info"])
        value["text"] = relayed.text + (value.get("text") or "")
        value["output_ids"] = relayed.output_ids + list(value.get("output_ids") or ())
        meta["id"] = relayed.id if relayed.id is not None else meta.get("id")
        completion = int(meta.get("completion_tokens") or 0) + before
        meta["completion_tokens"] = completion
        if relayed.prompt_tokens is not None:
            meta["prompt_tokens"] = relayed.prompt_tokens
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "length":
            meta["finish_reason"] = {**reason, "length": completion}  # max_new_tokens, whole
        value["meta_info"] = meta
        return data_event(value)
