"""Where a session's next turn goes: pure functions of plain values (issue 12, agentic sessions).

`routing.session_placement` says what a turn of a session whose prefix is cached on one server
does when the mode points at the other:

- ``request`` (the default): the mode decides, as for any request (the session stays only
  inside the hysteresis band, `session_affinity`);
- ``sticky``: the session stays where its prefix is, whatever the mode (new sessions and
  requests without a session follow the mode);
- ``move_pays``: it stays unless moving pays: the queueing it avoids on its server is worth
  more than prefilling its prefix again on the other, or staying would wake an idle server
  while the other runs (on shared GPUs the two servers' steps then take turns, and every
  stream of both slows down).

The prefix is estimated from the request (the gateway counts the body's bytes, about 4 per
token); the prefill speed and a stream's typical length are configured (`routing`
`prefill_tokens_per_s`, `session_stream_s`). docs/bench/routing-sessions.md has the figures:
on shared GPUs neither rule beats `request`, so it is the default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # policy imports this module
    from gateway.policy import BackendView

BYTES_PER_TOKEN = 4  # what a body's length says about its prompt, without tokenizing it


def prompt_tokens_from_bytes(body_bytes: int) -> int:
    """The gateway's estimate of a request's prompt tokens from its body's size."""
    return max(0, body_bytes) // BYTES_PER_TOKEN


def queue_wait_s(view: BackendView, stream_s: float) -> float:
    """How long one more request would wait for a running slot on this server: the requests
    ahead of it beyond the running cap, each slot freeing after about `stream_s`."""
    if view.effective_cap is None or view.effective_cap <= 0:
        return 0.0
    ahead = view.load + 1 - view.effective_cap
    return max(0, ahead) * stream_s / view.effective_cap


def move_pays(prefix_tokens: int, here: BackendView, there: BackendView, *,
              prefill_tokens_per_s: float, stream_s: float) -> bool:
    """Should a session whose prefix is cached `here` send its next turn `there`?"""
    if not there.healthy:
        return False
    if not here.healthy:
        return True
    if here.load == 0 and there.load > 0:
        return True  # staying would wake an idle server next to a running one
    saved = queue_wait_s(here, stream_s) - queue_wait_s(there, stream_s)
    return saved > prefix_tokens / prefill_tokens_per_s
