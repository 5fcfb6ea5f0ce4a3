"""The next server's events, rewritten so they go on the client's stream as one.

One splicer per continued stream, fed the whole events of the continuation as they come and
returning the bytes for the client. Chat, completions and /generate continue as themselves
(gateway/continuation/same_api.py); a Messages or Responses stream continues as chat (SGLang's
adapters never set continue_final_message: anthropic/serving.py:577-578,
serving_responses.py:746-765), and only that part is translated to the client's events, as
SGLang's own adapters translate a chat stream (as_messages.py, as_responses.py).

Usage counts the whole answer as SGLang would have for one request (seam.py).
"""

from __future__ import annotations

from gateway.apis import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from gateway.continuation.as_messages import MessagesSplicer
from gateway.continuation.as_responses import ResponsesSplicer
from gateway.continuation.same_api import ChatSplicer, CompletionSplicer, GenerateSplicer
from gateway.continuation.seam import Seam, Splicer

_SPLICERS: dict[tuple[str, str], type[Splicer]] = {
    (CHAT, CHAT): ChatSplicer, (COMPLETIONS, COMPLETIONS): CompletionSplicer,
    (GENERATE, GENERATE): GenerateSplicer, (MESSAGES, CHAT): MessagesSplicer,
    (RESPONSES, CHAT): ResponsesSplicer,
}


def splicer(client_path: str, continuation_path: str, seam: Seam) -> Splicer:
    """The splicer for a stream of `client_path` continued by a request to `continuation_path`."""
    return _SPLICERS[client_path, continuation_path](seam)
