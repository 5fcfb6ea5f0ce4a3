"""The HTTP app of one simulated vLLM 0.33.0 server (Starlette): the generation endpoints
(generation.py), /v1/models, /health, /ping, /version, /metrics with vLLM's names, and sleep
mode's endpoints (sleep.py) only in dev mode (``VLLM_SERVER_DEV_MODE=1``,
entrypoints/launchers/api_server/routers.py:46-53). The sim's own /sim/faults and /sim/state
are there as on the SGLang simulator."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.sim.admin import Admin
from gateway.sim.auth import ApiKeyMiddleware
from gateway.sim.context import ServerContext
from gateway.sim.replies import json_response
from gateway.sim.requests import RequestError
from gateway.sim.vllm import formats
from gateway.sim.vllm.generation import VllmGeneration
from gateway.sim.vllm.sleep import PAUSE_MODES, SleepMode, WakeFailed

VERSION = "0.33.0"


@dataclass(frozen=True)
class VllmOptions:
    """vLLM's flags and environment the simulator models."""

    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, /is_sleeping, /server_info
    # --enable-sleep-mode (None: the pair's shape's, on for turns and off for split, as
    # docker/compose.vllm-turns.yaml and compose.vllm.yaml start them). Off, a sleep frees
    # nothing: the weights and KV cache are not in the cuMem pools it unmaps
    # (v1/worker/gpu_worker.py:396-417).
    enable_sleep_mode: bool | None = None
    max_num_seqs: int | None = None  # --max-num-seqs (None: the profile's running cap)
    # The MTP server's speculative config: num_speculative_tokens (None: the profile's draft
    # steps) and num_speculative_tokens_per_batch_size, the dynamic schedule (dynamic.py).
    num_speculative_tokens: int | None = None
    draft_schedule: tuple[tuple[int, int, int], ...] | None = None


def check_max_num_seqs(max_num_seqs: int | None, mamba_blocks: int | None) -> None:
    """config/compilation.py:1511-1531: with full CUDA graphs (the default) a Mamba-hybrid
    model does not start when max_num_seqs exceeds its Mamba cache blocks."""
    if max_num_seqs is not None and mamba_blocks is not None and max_num_seqs > mamba_blocks:
        raise ValueError(
            f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({mamba_blocks}). Each "
            "decode sequence requires one Mamba cache block, so CUDA graph capture cannot proceed. "
            f"Please lower max_num_seqs to at most {mamba_blocks} or increase gpu_memory_utilization.")


class VllmApp:
    """The endpoint families of one simulated vLLM server; ``build()`` makes the ASGI app."""

    def __init__(self, context: ServerContext, sleep: SleepMode, options: VllmOptions) -> None:
        self.context = context
        self.sleep_mode = sleep
        self.options = options
        self.generation = VllmGeneration(context)
        self.admin = Admin(context)
        self.registry = CollectorRegistry()
        self.registry.register(_VllmCollector(context, sleep))

    def build(self, api_key: str | None = None) -> ASGIApp:
        app = Starlette(routes=self.routes())
        return ApiKeyMiddleware(app, api_key, None) if api_key else app

    def routes(self) -> list[Route]:
        get = ["GET"]
        routes = [
            *self.generation.routes(),
            Route("/v1/models", self.models, methods=get),
            Route("/health", self.health, methods=get),
            Route("/ping", self.health, methods=["GET", "POST"]),  # sagemaker/api_router.py:91-92
            Route("/version", self.version, methods=get),
            Route("/metrics", self.metrics, methods=get),
            *(route for route in self.admin.routes() if route.path.startswith("/sim/")),
        ]
        if self.options.dev_mode:
            routes += [Route("/sleep", self.sleep, methods=["POST"]),
                       Route("/wake_up", self.wake_up, methods=["POST"]),
                       Route("/is_sleeping", self.is_sleeping, methods=get),
                       Route("/server_info", self.server_info, methods=get)]  # fmt: skip
        return routes

    async def server_info(self, request: Request) -> Response:
        """dev/server_info/api_router.py:43-60: the engine's configuration (the fields the
        simulator has), as JSON with ``config_format=json``, else its text."""
        p = self.context.profile
        speculative = {"method": "mtp", "num_speculative_tokens": p.num_steps} if p.speculative else None
        config = {"model_config": {"model": p.served_model_name, "served_model_name": p.served_model_name,
                                   "max_model_len": p.context_length,
                                   "enable_sleep_mode": bool(self.options.enable_sleep_mode)},
                  "scheduler_config": {"max_num_seqs": p.effective_max_running,
                                       "max_num_batched_tokens": p.chunked_prefill_size},
                  "speculative_config": speculative}  # fmt: skip
        text = request.query_params.get("config_format", "text") == "text"
        return json_response({"vllm_config": str(config) if text else config,
                              "vllm_env": {"VLLM_SERVER_DEV_MODE": True}, "system_env": {}})

    async def models(self, request: Request) -> Response:
        """entrypoints/serve/engine/protocol.py:91-121 (ModelCard, ModelPermission)."""
        name, created = self.context.profile.served_model_name, int(self.context.started)
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                      "created": created, "allow_create_engine": False, "allow_sampling": True,
                      "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                      "allow_fine_tuning": False, "organization": "*", "group": None,
                      "is_blocking": False}  # fmt: skip
        card = {"id": name, "object": "model", "created": created, "owned_by": "vllm", "root": name,
                "parent": None, "max_model_len": self.context.profile.context_length,
                "permission": [permission]}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """instrumentator/health.py:22-33: 200 unless the engine is dead; asleep is not dead."""
        return Response(status_code=503 if self.context.faults.failing else 200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": VERSION})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # --- sleep mode (dev mode only) -------------------------------------------------------

    async def sleep(self, request: Request) -> Response:
        """POST /sleep?level=0|1|2&mode=abort|wait|keep (dev/sleep/api_router.py:26-34)."""
        try:
            level = _level(request.query_params.get("level", "1"))
            mode = request.query_params.get("mode", "abort")
            if mode not in PAUSE_MODES:
                raise RequestError("query.mode: Input should be 'abort', 'wait' or 'keep'",
                                   err_type="Bad Request", param="query.mode")
        except RequestError as exc:
            return validation_error_at(exc)
        await self.sleep_mode.sleep(level, mode)
        return json_response({"status": "sleeping", "level": level})

    async def wake_up(self, request: Request) -> Response:
        """POST /wake_up[?tags=...] (dev/sleep/api_router.py:44-55); a failure inside the engine
        core is the catch-all handler's 500 (exception_handling/handlers/exception.py:14-24)."""
        tags = tuple(request.query_params.getlist("tags")) or None
        try:
            awake = await self.sleep_mode.wake_up(tags)
        except WakeFailed as exc:
            return json_response(formats.error_body(500, str(exc), "InternalServerError"), 500)
        return json_response({"status": "awake" if awake else "sleeping",
                              "tags": list(tags) if tags is not None else None})

    async def is_sleeping(self, request: Request) -> Response:
        return json_response({"is_sleeping": self.sleep_mode.state.is_sleeping})


def _level(text: str) -> int:
    """``level: Annotated[int, Query(ge=0, le=2)]``."""
    try:
        level = int(text)
    except ValueError:
        raise RequestError("query.level: Input should be a valid integer", err_type="Bad Request",
                           param="query.level") from None
    if not 0 <= level <= 2:
        raise RequestError("query.level: Input should be less than or equal to 2"
                           if level > 2 else "query.level: Input should be greater than or equal to 0",
                           err_type="Bad Request", param="query.level")  # fmt: skip
    return level


def validation_error_at(exc: RequestError) -> Response:
    """A query parameter's validation error: its location is already the param."""
    body = formats.error_body(400, f"1 validation error:\n  {exc}", "Bad Request", exc.param)
    return json_response(body, 400)


class _VllmCollector(Collector):
    """The engine's gauges and counters under vLLM's names and labels (v1/metrics/loggers.py:499,
    :527-545, :593-615; v1/spec_decode/metrics.py:228-262), read at scrape time."""

    def __init__(self, context: ServerContext, sleep: SleepMode) -> None:
        self._context = context
        self._sleep = sleep

    def collect(self) -> Iterator[Any]:
        live, engine = self._context.live, self._context.live.engine
        labels = [engine.profile.served_model_name, "0"]
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Number of requests in model execution batches.",
                                    labels=["model_name", "engine"])  # fmt: skip
        running.add_metric(labels, float(engine.num_running))
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Number of requests waiting to be processed.",
                                    labels=["model_name", "engine"])  # fmt: skip
        waiting.add_metric(labels, float(engine.num_waiting + live.num_held))
        state = GaugeMetricFamily("vllm:engine_sleep_state", "Engine sleep state.",
                                  labels=["model_name", "engine", "sleep_state"])  # fmt: skip
        for name, value in self._sleep.sleep_state().items():
            state.add_metric([*labels, name], float(value))
        yield from (running, waiting, state)
        stats = engine.stats
        counters = [("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
                    ("vllm:generation_tokens", "Number of generation tokens processed.",
                     stats.generated_tokens)]  # fmt: skip
        if engine.profile.speculative:
            counters += [("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                          stats.spec_verify_ct),
                         ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                          stats.spec_proposed_drafts),
                         ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          stats.spec_accepted_drafts)]  # fmt: skip
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["model_name", "engine"])
            counter.add_metric(labels, float(value))
            yield counter


__all__ = ["VllmApp", "VllmOptions", "check_max_num_seqs"]
