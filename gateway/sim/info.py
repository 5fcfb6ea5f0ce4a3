"""What a simulated server says about itself: models, /model_info, /server_info, /v1/loads and
the Prometheus /metrics, in SGLang 0.5.23's shapes."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim.clients import ClientGone, until_or_disconnect
from gateway.sim.context import ServerContext
from gateway.sim.replies import json_response
from gateway.sim.saver import ServerDied

VERSION = "0.5.23"


class Info:
    def __init__(self, context: ServerContext) -> None:
        self.identity = context.identity
        self.live = context.live
        self.profile = context.profile
        self.metrics = context.metrics
        self.started = context.started
        self.saver = context.saver

    def routes(self) -> list[Route]:
        get = ["GET"]
        return [
            Route("/v1/models", self.models, methods=get),
            Route("/v1/models/{model:path}", self.model_card, methods=get),
            Route("/model_info", self.model_info, methods=get),
            Route("/get_model_info", self.model_info, methods=get),
            Route("/server_info", self.server_info, methods=get),
            Route("/get_server_info", self.server_info, methods=get),
            Route("/v1/loads", self.loads, methods=get),
            Route("/metrics", self.prometheus, methods=get),
        ]

    def _model_card(self) -> dict[str, Any]:
        name = self.profile.served_model_name
        return {"id": name, "object": "model", "created": int(self.started), "owned_by": "sglang",
                "root": name, "parent": None, "max_model_len": self.profile.context_length}  # fmt: skip

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request) -> Response:
        model = request.path_params["model"]
        if model == self.profile.served_model_name:
            return json_response(self._model_card())
        error = {"message": f"The model '{model}' does not exist", "type": "invalid_request_error",
                 "param": "model", "code": "model_not_found"}  # fmt: skip
        return json_response({"error": error}, 404)

    async def model_info(self, request: Request) -> Response:
        name = self.profile.served_model_name
        return json_response({
            "model_path": name, "tokenizer_path": name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default",
            "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "served_model_name": name, "reasoning_parser": "qwen3", "tool_call_parser": "qwen3_coder",
        })  # fmt: skip

    async def server_info(self, request: Request) -> Response:
        await self._scheduler_answers(request)
        return json_response(self.server_info_body())

    async def _scheduler_answers(self, request: Request) -> None:
        """/server_info asks the scheduler (get_internal_state, tokenizer_control_mixin.py:967):
        it answers after the control requests sent before it (a release in progress), and a
        hung one never; the handler waits until then or until its client leaves."""
        with contextlib.suppress(ClientGone, ServerDied):
            await until_or_disconnect(self.saver.after_control(), request)

    def server_info_body(self) -> dict[str, Any]:
        p, engine = self.profile, self.live.engine
        spec = p.speculative
        internal: dict[str, Any] = {
            "effective_max_running_requests_per_dp": p.effective_max_running,
            "last_gen_throughput": engine.stats.gen_throughput * self.live.speed,
            "memory_usage": {"weight": 61.2, "kvcache": 20.5, "token_capacity": p.prefix_cache_tokens,
                             "graph": 1.1},
        }  # fmt: skip
        if spec and engine.stats.spec_verify_ct:
            internal["avg_spec_accept_length"] = engine.stats.avg_spec_accept_length
        return {
            "model_path": p.served_model_name, "tokenizer_path": p.served_model_name,
            "served_model_name": p.served_model_name, "host": self.identity.host,
            "port": self.identity.port, "tp_size": 4, "dp_size": 1, "random_seed": self.identity.seed,
            "context_length": p.context_length, "chunked_prefill_size": p.chunked_prefill_size,
            "max_running_requests": p.resolved_max_running_requests,
            "max_queued_requests": p.max_queued_requests,
            "speculative_algorithm": "EAGLE" if spec else None,  # NEXTN resolves to EAGLE
            "speculative_num_steps": p.num_steps if spec else None,
            "speculative_eagle_topk": p.eagle_topk if spec else None,
            "speculative_num_draft_tokens": p.num_draft_tokens if spec else None,
            "mamba_radix_cache_strategy": "extra_buffer", "max_mamba_cache_size": p.mamba_slots,
            "enable_metrics": True, "mem_fraction_static": 0.45 if spec else 0.8,
            "launch_command": self._launch_command(),
            # The memory saver's flags, as build_server_info reports every server argument.
            "enable_memory_saver": self.saver.options.enable_memory_saver,
            "enable_weights_cpu_backup": self.saver.options.weights_cpu_backup,
            "enable_draft_weights_cpu_backup": self.saver.options.draft_weights_cpu_backup,
            "status": "ready", "max_total_num_tokens": p.prefix_cache_tokens,
            "max_req_input_len": p.context_length - 1, "startup_time": self.started,
            "internal_states": [internal], "version": VERSION, "frontend": "python",
        }  # fmt: skip

    def _launch_command(self) -> str:
        p = self.profile
        command = f"python -m sglang.launch_server --model-path {p.served_model_name} --tp 4"
        command += f" --port {self.identity.port} --enable-metrics"
        if p.speculative:
            command += f" --speculative-algorithm NEXTN --speculative-num-steps {p.num_steps}"
            command += f" --speculative-eagle-topk {p.eagle_topk}"
            command += f" --speculative-num-draft-tokens {p.num_draft_tokens}"
        saver = self.saver.options
        for flag, on in (("--enable-memory-saver", saver.enable_memory_saver),
                         ("--enable-weights-cpu-backup", saver.weights_cpu_backup),
                         ("--enable-draft-weights-cpu-backup", saver.draft_weights_cpu_backup)):  # fmt: skip
            command += f" {flag}" if on else ""
        return command + "  # simulated by mtp-gateway sim"

    async def loads(self, request: Request) -> Response:
        # Read from the schedulers' load snapshots (tokenizer_control_mixin.py:1001-1029), not
        # asked of the scheduler: it answers whatever the scheduler is doing.
        engine, p = self.live.engine, self.profile
        load: dict[str, Any] = {
            "timestamp": time.time(), "dp_rank": 0,
            "num_running_reqs": engine.num_running, "num_waiting_reqs": engine.num_waiting,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": engine.num_used_tokens,
            "num_total_tokens": p.prefix_cache_tokens, "max_total_num_tokens": p.prefix_cache_tokens,
            "max_running_requests": p.effective_max_running, "token_usage": engine.kv_token_usage,
            "gen_throughput": engine.stats.gen_throughput * self.live.speed,
            "cache_hit_rate": engine.cache_hit_rate,
            "utilization": engine.num_running / p.effective_max_running,
        }  # fmt: skip
        if p.speculative:
            load["speculative"] = {"accept_length": engine.stats.avg_spec_accept_length,
                                   "accept_rate": engine.stats.spec_accept_rate}  # fmt: skip
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        return json_response({"timestamp": stamp, "version": VERSION, "accelerator": "Simulated GPU",
                              "num_accelerators": 4, "loads": [load]})  # fmt: skip

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
