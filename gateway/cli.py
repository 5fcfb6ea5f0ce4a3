"""`mtp-gateway`: serve, demo, sim, bench, calibrate. The only module that exits."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from gateway.config import ConfigError, Settings, load_settings

EXIT_CONFIG = 2
M_MMAP_THRESHOLD = -3  # glibc's mallopt() parameter number
DEFAULT_CONFIG = "config.yaml"


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help=f"config file (default: ./{DEFAULT_CONFIG} if present)")
    parser.add_argument("--host", default=None, help="override listen.host")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument("--log-level", default="info")


def _load(args: argparse.Namespace) -> tuple[Settings, Path | None]:
    path = Path(args.config) if args.config else Path(DEFAULT_CONFIG)
    config_path = path if (args.config or path.exists()) else None
    settings = load_settings(config_path)
    listen = settings.listen.model_copy(update={
        k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    return settings.model_copy(update={"listen": listen}), config_path


def bounded_http_protocol(max_head_bytes: int) -> tuple[type[asyncio.Protocol] | str, int]:
    """uvicorn's HTTP protocol with the request head (request line + headers) bounded, and
    nothing kept alive for a connection the client reset.

    httptools buffers a header of any size (a 200 MB header costs 200 MB of memory); h11 has a
    limit of its own. Returns (protocol, h11 limit) for uvicorn.Config(http=...)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: h11, which bounds the head itself
        return "h11", max_head_bytes

    from gateway.errors import HeadersTooLarge

    class BoundedHeadProtocol(HttpToolsProtocol):
        _in_head = True  # the current request's head has not ended yet
        _head_ended = False  # ... and it ended during this data_received
        _pending = 0  # bytes received while the head is incomplete: what httptools buffers
        _head_size = 0  # request line and headers as parsed
        _refused = False

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            # uvicorn cancels the keep-alive timer only when the connection ends cleanly: a
            # client that resets it (an agent abandoning a stream) left its protocol, scope
            # and buffers alive for timeout_keep_alive (75 s), ~5 KB per aborted request.
            timer = self.timeout_keep_alive_task
            if timer is not None:
                timer.cancel()
                self.timeout_keep_alive_task = None

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            self._head_ended = False
            super().data_received(data)
            if self._refused or self._head_ended or not self._in_head:
                self._pending = 0
                return
            self._pending += len(data)
            if self._pending > max_head_bytes:  # a head still growing: stop buffering it
                self._refuse()

        def on_message_begin(self) -> None:
            self._in_head, self._head_size = True, 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_size += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_size += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head, self._head_ended = False, True
            if self._head_size > max_head_bytes:  # a whole head that came in one read
                self._refuse()
            if not self._refused:
                super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def _refuse(self) -> None:
            self._refused = True
            self.logger.warning("request head over %d bytes refused", max_head_bytes)
            if self.cycle is None or self.cycle.response_complete:  # nothing else in flight
                error = HeadersTooLarge(f"request line and headers exceed {max_head_bytes} bytes")
                body = error.to_bytes()
                self.transport.write(
                    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                    b"content-type: application/json\r\ncontent-length: "
                    + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    return BoundedHeadProtocol, max_head_bytes


def uvicorn_config(app: object, settings: Settings, log_level: str) -> uvicorn.Config:
    http, h11_limit = bounded_http_protocol(settings.limits.max_header_bytes)
    return uvicorn.Config(
        app, host=settings.listen.host, port=settings.listen.port, log_level=log_level,
        http=http, h11_max_incomplete_event_size=h11_limit,  # type: ignore[arg-type]
        access_log=False,  # a log line per request costs more than relaying it
        # A float: int() made 1.5 s one second, and any grace under 1 s "wait forever".
        timeout_graceful_shutdown=settings.timeouts.shutdown_grace_s,  # type: ignore[arg-type]
        timeout_keep_alive=75,
        # X-Forwarded-* rewriting costs per request and nothing here reads client addresses.
        proxy_headers=False,
    )


class _Server(uvicorn.Server):
    """uvicorn, except that a drained gateway exits 0.

    After its graceful shutdown uvicorn re-raises the signal that stopped it, under the
    handler that was there before (the default one): the process then dies by SIGTERM
    (exit -15) although every stream was drained or ended properly."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()


async def serve(settings: Settings, config_path: Path | None, log_level: str) -> None:
    from gateway.app import create_app

    app = create_app(settings, config_path=config_path)
    await _Server(uvicorn_config(app, settings, log_level)).serve()


async def demo(settings: Settings, config_path: Path | None, log_level: str,
               time_scale: float) -> None:
    from gateway.sim.server import SimOptions, start_sim_pair

    options = SimOptions(time_scale=time_scale, mtp_port=_port(settings.backends.mtp.url),
                         plain_port=_port(settings.backends.plain.url))
    async with start_sim_pair(options) as pair:
        print(f"simulated SGLang pair: mtp {pair.urls['mtp']}  plain {pair.urls['plain']}")
        print(f"gateway: http://{settings.listen.host}:{settings.listen.port}/v1  "
              f"(dashboard: /dashboard, metrics: /metrics)")
        await serve(settings, config_path, log_level)


def tune_process() -> None:
    """Process-wide settings for a long-running proxy, applied once by `serve` and `demo`.

    - glibc maps a fresh region for every buffer over 128 KB and unmaps it on free, so each
      400 KB agent-context body page-faults its way in (measured: ~1.3 ms of the gateway's
      4.5 ms CPU per such request). A 4 MB threshold keeps such buffers on the heap.
    - The request path creates almost no reference cycles, but full collections still walk
      every object: start-up objects are frozen out of the collector, so they are not walked.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 4 * 1024 * 1024)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune
    gc.collect()
    gc.freeze()


def use_fast_event_loop() -> None:
    """uvloop when installed (uvicorn[standard] brings it). uvicorn.run() would pick it itself,
    but we run uvicorn.Server inside our own asyncio.run(), which starts the stock loop."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _port(url: str) -> int:
    from urllib.parse import urlsplit

    return urlsplit(url).port or 80


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtp-gateway",
        description="Adaptive gateway: MTP SGLang server when quiet, plain server when saturated.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_arguments(commands.add_parser("serve", help="run the gateway"))
    demo_parser = commands.add_parser("demo", help="gateway + two simulated SGLang servers")
    _add_serve_arguments(demo_parser)
    demo_parser.add_argument("--time-scale", type=float, default=1.0,
                             help="simulated time per real second (1.0 = real speed)")
    sim_parser = commands.add_parser("sim", help="two simulated SGLang servers (mtp + plain)")
    _add_optional(sim_parser, "gateway.sim.cli")
    for name, module, help_text in (
        ("bench", "gateway.bench.bench_cli", "load sweeps over HTTP or in virtual time"),
        ("calibrate", "gateway.bench.calibrate_cli", "measure both backends, set the crossover"),
        ("overhead", "gateway.bench.overhead", "the gateway's own cost per request and chunk"),
    ):
        _add_optional(commands.add_parser(name, help=help_text), module)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command in ("serve", "demo"):
            settings, config_path = _load(args)
            use_fast_event_loop()
            tune_process()
            if args.command == "serve":
                asyncio.run(serve(settings, config_path, args.log_level))
            else:
                asyncio.run(demo(settings, config_path, args.log_level, args.time_scale))
            return 0
        return int(args.run(args))
    except ConfigError as exc:
        print(f"mtp-gateway: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 0


def _add_optional(parser: argparse.ArgumentParser, module: str) -> None:
    """Subcommands defined by their own package: add_arguments(parser) and run(args) -> int."""
    import importlib

    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise  # a real import error inside the module: do not hide it
        parser.set_defaults(run=lambda _args: _missing(module))
        return
    mod.add_arguments(parser)
    parser.set_defaults(run=mod.run)


def _missing(module: str) -> int:
    print(f"mtp-gateway: {module} is not available in this install", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
