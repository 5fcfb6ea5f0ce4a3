"""Park the first server of a turns pair before the second one starts (docker/compose.turns.yaml,
deploy/k8s/overlays/pair-turns).

    python -m gateway.deploy.park --server http://sglang-plain:30002 --other http://sglang-mtp:30001

SGLang 0.5.23 sizes a server on the GPU memory free when it starts (distributed/bootstrap.py:
193-223), so the second server of a turns pair must start only once the first has given its
memory back. This waits for the first server's GET /ready (200 once it has started and warmed
up, managers/tokenizer_manager.py:732-734), then parks it:

1. POST /pause_generation {"mode": "retract"} (entrypoints/http_server.py:1831): new requests
   then wait in the tokenizer instead of reaching a released scheduler, which would crash it;
2. POST /release_memory_occupation {} (http_server.py:1575; no tags = weights, KV cache and
   CUDA graphs): 200 once every rank has released (the scheduler is idle: nothing was sent to
   it yet, and the pause lets waiting requests stay, weight_updater.py:339-341).

It never releases twice (a second release of the same tags kills the server): it parks only a
server that answers /ready 200 while the other server is not up. Run again on a live pair (say
`docker compose up -d` a second time), it finds the other server up and does nothing: from then
on the gateway owns the pair's turns. Standard library only; the admin key is read from
SGLANG_ADMIN_KEY (the memory-saver endpoints are admin-optional, utils/auth.py:133-144).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request


def call(url: str, body: object | None = None, key: str | None = None, timeout: float = 10.0) -> int:
    """The HTTP status of a GET (no body) or a JSON POST; 0 when nothing answers."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("content-type", "application/json")
    if key:
        request.add_header("authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return error.code
    except (urllib.error.URLError, OSError):
        return 0


def park(server: str, other: str, key: str | None, wait_s: float, release_timeout_s: float) -> str:
    """Park ``server`` if it is the one to park; returns what was done."""
    if call(f"{other}/ping") == 200:
        return f"{other} is up: the pair is running, its turns are the gateway's; nothing done"
    deadline = time.monotonic() + wait_s
    while call(f"{server}/ready") != 200:
        if call(f"{server}/ping") == 200:  # started, but paused: parked already
            return f"{server} is paused already (/ready 503, /ping 200); nothing done"
        if time.monotonic() > deadline:
            raise SystemExit(f"park: {server} not ready after {wait_s:.0f} s")
        time.sleep(5)
    status = call(f"{server}/pause_generation", {"mode": "retract"}, key)
    if status != 200:
        raise SystemExit(f"park: {server}/pause_generation answered {status}")
    status = call(f"{server}/release_memory_occupation", {}, key, timeout=release_timeout_s)
    if status != 200:
        raise SystemExit(f"park: {server}/release_memory_occupation answered {status}; "
                         "do not call it again (a second release kills the server)")
    return f"{server} paused and released: the other server may start"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway.deploy.park",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the first server, to park")
    parser.add_argument("--other", required=True, help="the second server, not started yet")
    parser.add_argument("--wait-s", type=float, default=3600.0, help="how long to wait for /ready")
    parser.add_argument("--release-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    key = os.environ.get("SGLANG_ADMIN_KEY") or None
    print("park:", park(args.server.rstrip("/"), args.other.rstrip("/"), key, args.wait_s,
                        args.release_timeout_s), flush=True)


if __name__ == "__main__":
    main()
