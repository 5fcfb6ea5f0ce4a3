"""Memory one stream's transcript holds (handoff.transcript_chunks), measured with tracemalloc
over a fixed amount of work: a chat stream of TOKENS SGLang-shaped events (one token a piece,
as the overhead benchmark's upstream sends them) appended as the pump appends them, with the
watchdog's look (Exchange.bound_transcript) every LOOK_EVERY pieces (a quarter of keepalive_s,
3.75 s, at 200 pieces a second).

    python lab/scripts/transcript_memory.py [--tokens 32768] [--look-every 750]
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from typing import Any, cast

from gateway.config import Handoff
from gateway.relay.exchange import Exchange


def piece(i: int) -> bytes:
    chunk = {"id": "0123456789abcdef0123456789abcdef", "object": "chat.completion.chunk",
             "created": 1764633600, "model": "Qwen/Qwen3.5-122B-A10B",
             "choices": [{"index": 0, "delta": {"content": f" w{i % 1000}"}, "logprobs": None,
                          "finish_reason": None, "matched_stop": None}]}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def stream(bound: int, tokens: int, look_every: int) -> tuple[int, int]:
    """(peak, held at the end) bytes of one stream's transcript."""
    tracemalloc.start()
    exchange = Exchange(cast(Any, None), [], cast(Any, None), 0.0, cast(Any, None),
                        transcript_chunks=bound)
    for i in range(tokens):
        exchange.recent.append(piece(i))
        if i % look_every == look_every - 1:
            exchange.bound_transcript()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--look-every", type=int, default=750)
    args = parser.parse_args()
    default = Handoff().transcript_chunks
    print(f"one chat stream of {args.tokens} pieces ({len(piece(0))} bytes each), a look every "
          f"{args.look_every} pieces")
    for name, bound in (("unbounded", args.tokens + 1), (f"transcript_chunks {default}", default)):
        peak, held = stream(bound, args.tokens, args.look_every)
        print(f"{name:>26}: peak {peak / 1e6:6.2f} MB, held at the end {held / 1e6:6.2f} MB")


if __name__ == "__main__":
    main()
