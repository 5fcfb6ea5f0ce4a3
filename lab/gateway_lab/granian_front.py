"""Issue 21's "a compiled HTTP front", measured: an ASGI app on granian (Rust, hyper/tokio)
instead of uvicorn, for `mtp-gateway overhead --granian`. A prototype for the benchmark, not a
way to serve: granian is not a dependency (`pip install granian`), and the gateway on it has
no bounded request head and no body writer (granian offers neither), so the relay takes its
ASGI `send` path, one message a piece.

    python -m gateway_lab.granian_front --config FILE [--host H --port P]

serves the gateway (the config as `mtp-gateway serve` reads it) on granian's embedded server,
whose threads all run in this one process (the benchmark reads one pid's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from typing import Any


def serve_granian(app: Any, host: str, port: int) -> None:
    """Serve `app` (ASGI, with its lifespan) on granian until interrupted; prints
    `READY <port>` once a connection is accepted."""
    import uvloop
    from granian.constants import Interfaces
    from granian.server.embed import Server

    server = Server(app, address=host, port=port, interface=Interfaces.ASGI, log_enabled=False,
                    backlog=4096)

    async def main() -> None:
        ready = asyncio.create_task(_say_ready(host, port))
        try:
            await server.serve()
        finally:
            ready.cancel()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


async def _say_ready(host: str, port: int) -> None:
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        print(f"READY {port}", flush=True)
        return


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def gateway_from_argv(prog: str, doc: str | None, argv: list[str] | None) -> tuple[Any, str, int]:
    """(the gateway's ASGI app, host, port) from `--config FILE [--host H] [--port P]`, the
    process set up as `mtp-gateway serve` sets it up (its log handler, its tuning)."""
    from gateway.access_log import log_handler
    from gateway.app import create_app
    from gateway.cli import tune_process
    from gateway.config import load_settings

    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, handlers=[log_handler()])
    tune_process()
    return create_app(load_settings(args.config), config_path=args.config), args.host, args.port


def main(argv: list[str] | None = None) -> int:
    app, host, port = gateway_from_argv("granian_front", __doc__, argv)
    serve_granian(app, host, port or free_port())
    return 0


if __name__ == "__main__":
    sys.exit(main())
