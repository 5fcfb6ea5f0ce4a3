"""``mtp-gateway sim``: both simulated SGLang servers until Ctrl+C.

The lead's gateway/cli.py calls :func:`add_arguments` and :func:`run`; ``python -m gateway.sim``
does the same on its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from gateway.sim.faults import Faults
from gateway.sim.profile import load_profiles
from gateway.sim.saver import SaverOptions
from gateway.sim.server import SimOptions, SimPair, start_sim_pair
from gateway.sim.speed import add_speed_argument
from gateway.sim.vllm.app import VllmOptions
from gateway.sim.vllm.dynamic import validate_schedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface for both servers")
    parser.add_argument("--mtp-port", type=int, default=30001, help="port of the MTP server")
    parser.add_argument("--plain-port", type=int, default=30002, help="port of the plain server")
    parser.add_argument("--profiles", metavar="FILE", help="profiles YAML (default: built-in)")
    add_speed_argument(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed for text and draft acceptance")
    parser.add_argument(
        "--no-shared-device", dest="shared_device", action="store_false",
        help="give each server its own simulated GPU (default: one shared GPU)",
    )  # fmt: skip
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (as SGLang)")
    parser.add_argument("--admin-api-key", help="the key /abort_request then needs (as SGLang)")
    parser.add_argument(
        "--max-queued-requests", type=int, metavar="N",
        help="SGLang's waiting-queue limit; beyond it a stream gets its error inside a 200, a "
        "non-stream request a 503 (default: unbounded, or the profiles')",
    )  # fmt: skip
    parser.add_argument("--enable-response-store", action="store_true",
                        help="keep /v1/responses for previous_response_id and GET (SGLang: off)")
    parser.add_argument("--enable-request-header-overrides", action="store_true",
                        help="read x-override-rid, as SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES=1")
    parser.add_argument("--memory", choices=("split", "turns"), default="split",
                        help="split: both resident, sharing the GPUs' memory; turns: one device "
                        "they take turns owning (plain parked, MTP holding at start)")
    vllm = parser.add_argument_group("vLLM (with --engine vllm)")
    vllm.add_argument("--engine", choices=("sglang", "vllm"), default="sglang",
                      help="what both servers speak: SGLang 0.5.23 or vLLM 0.33.0")
    vllm.add_argument("--vllm-dev-mode", action="store_true",
                      help="as VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /is_sleeping (default "
                      "with --memory turns)")
    vllm.add_argument("--enable-sleep-mode", action="store_true", default=None,
                      help="as vLLM's flag: a sleep frees the memory (default with --memory turns; "
                      "without it a sleep frees nothing)")
    vllm.add_argument("--max-num-seqs", type=int, metavar="N",
                      help="vLLM's running cap; above the Mamba cache blocks the server does not start")
    vllm.add_argument("--num-speculative-tokens", type=int, metavar="K",
                      help="the MTP server's draft tokens a step (default: the profile's)")
    vllm.add_argument("--num-speculative-tokens-per-batch-size", type=_schedule, metavar="JSON",
                      help="the MTP server's dynamic schedule, e.g. '[[1,4,2],[5,512,0]]' (vLLM PR #32374)")
    saver = parser.add_argument_group("memory saver (SGLang's flags and environment, both servers)")
    saver.add_argument("--enable-memory-saver", action="store_true",
                       help="as SGLang: release/resume move memory (else they only check and flush)")
    saver.add_argument("--enable-weights-cpu-backup", action="store_true",
                       help="keep a host copy of the weights (target and draft) across a release")
    saver.add_argument("--enable-draft-weights-cpu-backup", action="store_true",
                       help="keep a host copy of the draft weights only")
    saver.add_argument("--memory-saver-cuda-graph", action="store_true",
                       help="as SGLANG_MEMORY_SAVER_CUDA_GRAPH=1: the CUDA graphs are released too")
    saver.add_argument("--retain-cpu-backup", action="store_true",
                       help="as TMS_RETAIN_CPU_BACKUP=1: keep the host copy after a resume")
    for name in ("mtp", "plain"):
        parser.add_argument(
            f"--{name}-faults", metavar="JSON", type=_faults,
            help=f'faults of the {name} server at start, as POST /sim/faults takes them, e.g. '
            '\'{"slow_factor": 3}\'',
        )  # fmt: skip


def _schedule(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        return validate_schedule(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"bad schedule {text!r}: {exc}") from exc


def _faults(text: str) -> Faults:
    try:
        return Faults.from_json(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"bad faults {text!r}: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Returns the process exit code."""
    try:
        profiles = load_profiles(args.profiles)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"sim: cannot load profiles: {exc}", file=sys.stderr)
        return 2
    faults = {name: f for name in ("mtp", "plain") if (f := getattr(args, f"{name}_faults"))}
    options = SimOptions(
        host=args.host, mtp_port=args.mtp_port, plain_port=args.plain_port, profiles=profiles,
        speed=args.speed, seed=args.seed, shared_device=args.shared_device,
        api_key=args.api_key, faults=faults, admin_api_key=args.admin_api_key,
        max_queued_requests=args.max_queued_requests, enable_response_store=args.enable_response_store,
        request_header_overrides=args.enable_request_header_overrides, saver=_saver_options(args),
        memory=args.memory, engine=args.engine,
        vllm=VllmOptions(dev_mode=args.vllm_dev_mode or args.memory == "turns",
                         enable_sleep_mode=args.enable_sleep_mode,
                         max_num_seqs=args.max_num_seqs, num_speculative_tokens=args.num_speculative_tokens,
                         draft_schedule=args.num_speculative_tokens_per_batch_size),
    )  # fmt: skip
    try:
        asyncio.run(_serve(options))
    except ValueError as exc:  # a flag the simulated server refuses at start
        print(f"sim: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sim: cannot listen: {exc}", file=sys.stderr)
        return 1
    return 0


def _saver_options(args: argparse.Namespace) -> SaverOptions | None:
    """The memory saver's flags given on the command line, or None (the memory shape's own)."""
    flags = ("enable_memory_saver", "enable_weights_cpu_backup", "enable_draft_weights_cpu_backup",
             "memory_saver_cuda_graph", "retain_cpu_backup")  # fmt: skip
    if not any(getattr(args, flag, False) for flag in flags):
        return None
    return SaverOptions(enable_memory_saver=args.enable_memory_saver,
                        weights_cpu_backup=args.enable_weights_cpu_backup,
                        draft_weights_cpu_backup=args.enable_draft_weights_cpu_backup,
                        cuda_graph_in_saver=args.memory_saver_cuda_graph,
                        retain_cpu_backup=args.retain_cpu_backup)  # fmt: skip


async def _serve(options: SimOptions) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with start_sim_pair(options) as pair:
        device = "one shared simulated GPU" if options.shared_device else "separate GPUs"
        device += f", {'vLLM 0.33.0' if options.engine == 'vllm' else 'SGLang 0.5.23'}"
        head = "MTP" if options.engine == "vllm" else "NEXTN"
        print(f"sim: mtp   ({head}, cap {_cap(pair, 'mtp')}) on {pair.urls['mtp']}")
        print(f"sim: plain (cap {_cap(pair, 'plain')}) on {pair.urls['plain']}")
        print(f"sim: {device}, speed {options.speed:g}x, seed {options.seed}; Ctrl+C stops")
        sys.stdout.flush()  # whoever started us may be waiting for the URLs on a pipe
        await stop.wait()


def _cap(pair: SimPair, name: str) -> int:
    return pair.servers[name].live.engine.profile.effective_max_running


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.sim", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
