"""What the gateway estimates about a request's prompt without tokenizing it.

Where a session's next turn goes is the mode's decision (gateway.policy, `session_affinity`
inside the hysteresis band). Two rules that kept a session with its prefix outside the band
(`sticky`, and `move_pays`: move only when the queue avoided pays for re-prefilling) lost on
shared GPUs and were removed: docs/bench/routing-sessions.md has the figures.
"""

from __future__ import annotations

BYTES_PER_TOKEN = 4  # what a body's length says about its prompt, without tokenizing it


def prompt_tokens_from_bytes(body_bytes: int) -> int:
    """The gateway's estimate of a request's prompt tokens from its body's size."""
    return max(0, body_bytes) // BYTES_PER_TOKEN
