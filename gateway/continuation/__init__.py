"""Continue a running stream on another server, so the client sees one stream.

Pure (no I/O, no clock), in three steps per API, each fed what the relay already has:

- `transcript.read`: what has been relayed of a stream (the whole SSE events the relay framed,
  kept as bytes on the hot path and parsed only here, when a continuation is wanted);
- `rules.refusal`: why a stream cannot be continued faithfully (None: it can), each rule
  decided with SGLang 0.5.23's source (docs/compat.md, "Continuing a running stream");
- `requests.continuation`: the request the next server is asked (the original one with the
  partial answer, the token limit less what was generated, a new rid);
- `splice.splicer`: rewrites the next server's events so they go on the client's stream: one
  id, one start, indexes that go on, one finish, usage for the whole answer.
"""

from __future__ import annotations

from gateway.continuation.requests import Continuation, continuation
from gateway.continuation.rules import refusal
from gateway.continuation.seam import Seam, Splicer
from gateway.continuation.splice import splicer
from gateway.continuation.transcript import Relayed, read

__all__ = ["Continuation", "Relayed", "Seam", "Splicer", "continuation", "read", "refusal",
           "splicer"]
