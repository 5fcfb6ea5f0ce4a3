"""The engine seam: what the gateway knows about the inference server behind it that is the
engine's own, not the OpenAI, Anthropic or Responses API's.

One module per engine: `sglang` (SGLang 0.5.23) and `vllm` (vLLM 0.33.0). A pair's engine is
its configuration's (`Settings.engine_of`); the core gets a backend's module from
`gateway.upstream.engine.seam.engine_of(backend)` and uses only what it names (`seam.Engine`).
The ids set at admission, before a pair is chosen, are SGLang's names (vLLM ignores them,
docs/compat.md). What a module names:

- request ids: which body field or header carries the id the engine will use (`RID_FIELDS`,
  `RID_HEADER`, `RID_HEADER_PATHS`, `RESPONSE_ID_PREFIX`), a fresh one (`new_rid`), and the ids
  the engine gives the work of one request (`abort_rids`);
- aborting a request's work now (`abort`, with the engine's rule for which key it needs);
- what the monitor reads: the load and server-info endpoints and their parsing
  (`LOADS`, `SERVER_INFO`, `parse_loads`, `parse_server_info`), the probe of a server without
  them (`MODELS`), and the health and readiness endpoints (`HEALTH`, `HEALTH_GENERATE`, `READY`);
- the turns controller's calls to one server (`control`: SGLang's memory saver, vLLM's sleep
  mode), in their own section.

Another engine is a module with the same names (mypy checks it against `seam.Engine`), its
hand-over steps in gateway/turns/state.py `HANDOVERS`, and its tests."""
