"""The engine seam: what the gateway knows about the inference server behind it that is the
engine's own, not the OpenAI, Anthropic or Responses API's.

One module per engine; `gateway.upstream.engine.sglang` (SGLang 0.5.23) is the one there is. Core
modules import it as `from gateway.upstream.engine import sglang as engine` and use only what it names:

- request ids: which body field or header carries the id the engine will use (`RID_FIELDS`,
  `RID_HEADER`, `RID_HEADER_PATHS`, `RESPONSE_ID_PREFIX`), a fresh one (`new_rid`), and the ids
  the engine gives the work of one request (`abort_rids`);
- aborting a request's work now (`abort`, with the engine's rule for which key it needs);
- what the monitor reads: the load and server-info endpoints and their parsing
  (`LOADS`, `SERVER_INFO`, `parse_loads`, `parse_server_info`), the probe of a server without
  them (`MODELS`), and the health and readiness endpoints (`HEALTH`, `HEALTH_GENERATE`, `READY`);
- the memory-saver calls (pause, release and resume memory, continue), in their own section.

A second engine is a module with the same names, and its tests."""
