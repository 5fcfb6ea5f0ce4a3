"""`mtp-gateway`: serve, demo, sim, bench, calibrate. The only module that exits."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gateway.access_log import log_handler
from gateway.config import ROLES, ConfigError, Settings, load_settings
from gateway.front.server import GatewayServer, uvicorn_config
from gateway.sim.speed import add_speed_argument

EXIT_CONFIG = 2
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameter numbers
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


log = logging.getLogger("mtp_gateway")


async def serve(settings: Settings, config_path: Path | None, log_level: str) -> None:
    from gateway.app import create_app

    app = create_app(settings, config_path=config_path)
    await GatewayServer(uvicorn_config(app, settings, log_level)).serve()


async def demo(settings: Settings, config_path: Path | None, log_level: str,
               speed: float, memory: str | None = None, engine: str = "sglang",
               say: Callable[[str], None] = print) -> None:
    """`memory`: the pair's shape, for the simulated servers and the gateway alike (None: the
    configuration's; `auto`, the default, runs the simulated pair with the memory saver, or a
    vLLM pair in sleep mode and dev mode, so the gateway finds it can take turns). `engine`:
    what the simulated servers speak (SGLang 0.5.23 or vLLM 0.33.0). Says on the terminal what
    it waits for, then `ready`."""
    from gateway.app import create_app
    from gateway.sim.memory import TURNS_FIRST
    from gateway.sim.server import SimOptions, start_sim_pair
    from gateway.sim.vllm.app import VllmOptions

    if memory is not None:
        settings = settings.model_copy(update={"memory": memory})
    settings = device_time_at_speed(settings.model_copy(update={"engine": engine}), speed)
    shape = settings.memory_of(settings.fleet()[0])
    turns = shape in ("turns", "auto")
    sim_memory = "turns" if turns else "split"
    options = SimOptions(speed=speed, mtp_port=_port(settings.backends.mtp.url),
                         plain_port=_port(settings.backends.plain.url), memory=sim_memory,
                         engine=engine, vllm=VllmOptions(dev_mode=sim_memory == "turns"))
    name = "vLLM" if engine == "vllm" else "SGLang"
    if sim_memory == "turns":
        first = TURNS_FIRST
        second = next(role for role in ROLES if role != first)
        parked = ("with the memory saver: {} starts and is parked (paused, its memory released: its "
                  "first release copies its weights to host memory, as SGLang's does" if engine == "sglang"
                  else "in sleep mode: {} starts and sleeps (level 1: its weights copied to a fresh host "
                  "buffer, as vLLM's allocator does").format(first)
        say(f"starting the simulated {name} pair {parked}: ~{PARK_S / speed:.0f} s at --speed "
            f"{speed:g}), then {second} starts on the memory {first} freed ...")
    started = time.monotonic()
    async with start_sim_pair(options) as pair:
        say(f"simulated {name} pair ({sim_memory} memory, up in {time.monotonic() - started:.1f} s): "
            f"mtp {pair.urls['mtp']}  plain {pair.urls['plain']}")
        settings = with_backend_urls(settings, pair.urls)
        app = create_app(settings, config_path=config_path)
        server = GatewayServer(uvicorn_config(app, settings, log_level))
        serving = asyncio.create_task(server.serve())
        try:
            url = await _until_ready(server, app.state.runtime, serving, say)
            say(f"ready: {url}/v1  (dashboard: {url}/dashboard, metrics: {url}/metrics)")
            await asyncio.shield(serving)  # cancelled (a test's end): a graceful stop below
        finally:
            server.should_exit = True
            await asyncio.gather(serving, return_exceptions=True)


# Seconds the simulated pair takes to start in turns at --speed 1, most of it the modelled first
# release of the parked server's weights (gateway/sim/saver.py FIRST_PAUSE_S). Measured: the
# demo's own figure on its pair's line, `up in 14.7 s` (`mtp-gateway demo`, a shared 2-core box).
PARK_S = 15.0


def with_backend_urls(settings: Settings, urls: Mapping[str, str]) -> Settings:
    """The demo's gateway pointed at the simulated servers where they listen (a port 0 in the
    configuration is the port the system gave them)."""
    backends = settings.backends.model_copy(update={
        role: settings.backends.get(role).model_copy(update={"url": urls[role]}) for role in ROLES})
    return settings.model_copy(update={"backends": backends})


READY_POLL_S = 0.05


async def _until_ready(server: GatewayServer, runtime: Any, serving: asyncio.Task[None],
                       say: Callable[[str], None]) -> str:
    """The gateway's URL once it listens and its pair admits; says what it waits for meanwhile."""
    while not server.started:
        if serving.done():
            serving.result()  # what stopped it (a port in use ...)
            raise SystemExit("mtp-gateway: the gateway stopped before it started")
        await asyncio.sleep(READY_POLL_S)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    url = f"http://{host}:{port}"
    pair = next(iter(runtime.pool.pairs.values()))
    said = ""
    while pair.turns is not None and pair.turns.admitting is None:
        memory = pair.turns.describe()
        plan = ", ".join(memory.get("plan") or [])
        waits = memory.get("reason") or memory.get("stuck") or (
            f"{memory['phase']} on {memory.get('target') or 'a server'}: {plan}")
        if waits != said:
            say(f"gateway listening on {url}; its pair does not admit yet: {waits}")
            said = waits
        await asyncio.sleep(READY_POLL_S)
    return url


# The turns' waits on the device itself (a release, a resume, the server ready again): the
# simulated device takes them in modelled time.
_DEVICE_WAITS = ("call_timeout_s", "release_timeout_s", "resume_timeout_s", "ready_within_s")


def device_time_at_speed(settings: Settings, speed: float) -> Settings:
    """The demo's settings with the turns' device waits stretched to a simulated pair slower
    than the modelled GPUs (speed < 1: modelled seconds per real second): a release that
    takes 15 s on the modelled device takes 75 s at --speed 0.2, and the real default (60 s)
    would fail every turn. Faster pairs keep the real defaults."""
    if speed >= 1:
        return settings
    turns = settings.turns
    stretched = {name: getattr(turns, name) / speed for name in _DEVICE_WAITS}
    return settings.model_copy(update={"turns": turns.model_copy(update=stretched)})


YOUNG_COLLECTION_EVERY = 10_000  # container allocations between young collections (700)


def tune_process() -> None:
    """Process-wide settings for a long-running proxy, applied once by `serve` and `demo`.

    - glibc maps a fresh region for every buffer over 128 KB and unmaps it on free, so each
      400 KB agent-context body page-faults its way in (measured on cf35b98: ~1.3 ms of the
      gateway's 4.5 ms CPU per such request; lab/results/perf/profile-c128.md). A 4 MB threshold
      keeps such buffers on the heap, and a 64 MB trim threshold keeps the heap from being
      handed back after every such request (258 page faults per request without it, read
      from /proc; lab/results/perf/profile-c128.md). The price: up to 64 MB of freed heap stays
      mapped after a burst of large bodies.
    - The request path creates no reference cycles (a test guards it), but full collections
      still walk every object: start-up objects are frozen out of the collector. And young
      collections, every 700 container allocations by default, find nothing to free but walk
      the in-flight requests' objects and promote them towards the full collections: at C=128
      x 16 tokens the collector took 63k instructions a request; one young collection every
      10,000 allocations halves that (callgrind, `mtp-gateway overhead --callgrind`).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 4 * 1024 * 1024)
        libc.mallopt(M_TRIM_THRESHOLD, 64 * 1024 * 1024)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])


def use_fast_event_loop() -> None:
    """uvloop when installed (uvicorn[standard] brings it). uvicorn.run() would pick it itself,
    but we run uvicorn.Server inside our own asyncio.run(), which starts the stock loop."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def add_memory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--memory", choices=("split", "turns"), default=None,
                        help="how the pair shares its GPUs' memory: split (each its share) or "
                        "turns (each sized for all of it, handed over by the gateway with "
                        "SGLang's memory saver or vLLM's sleep mode); default: the configuration's "
                        "`memory` (auto, its default: the simulated pair with the memory saver, "
                        "or vLLM's in sleep mode and dev mode, so turns)")


def _port(url: str) -> int:
    from urllib.parse import urlsplit

    port = urlsplit(url).port
    return 80 if port is None else port  # 0: any free port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtp-gateway",
        description="Adaptive gateway: MTP SGLang server when quiet, plain server when saturated.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_arguments(commands.add_parser("serve", help="run the gateway"))
    demo_parser = commands.add_parser("demo", help="gateway + two simulated SGLang servers")
    _add_serve_arguments(demo_parser)
    add_speed_argument(demo_parser)
    add_memory_argument(demo_parser)
    demo_parser.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                             help="what the simulated servers speak: SGLang 0.5.23 or vLLM 0.33.0")
    sim_parser = commands.add_parser("sim", help="two simulated SGLang servers (mtp + plain)")
    _add_optional(sim_parser, "gateway.sim.cli")
    for name, module, help_text in (
        ("bench", "gateway.bench.bench_cli", "load sweeps over HTTP or in virtual time"),
        ("calibrate", "gateway.bench.calibrate_cli", "measure both backends, set the crossover"),
        ("overhead", "gateway_lab.overhead", "the gateway's own cost per request and chunk (the lab)"),
    ):
        _add_optional(commands.add_parser(name, help=help_text), module)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, handlers=[log_handler()])
    try:
        if args.command in ("serve", "demo"):
            settings, config_path = _load(args)
            use_fast_event_loop()
            tune_process()
            if args.command == "serve":
                asyncio.run(serve(settings, config_path, args.log_level))
            else:
                asyncio.run(demo(settings, config_path, args.log_level, args.speed,
                                 args.memory, args.engine))
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
    how = (" (it is the lab's, outside the wheel: from a checkout, python3 -m pip install -e lab)"
           if module.startswith("gateway_lab.") else "")
    print(f"mtp-gateway: {module} is not available in this install{how}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
