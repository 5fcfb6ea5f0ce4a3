"""A simulated vLLM 0.33.0 server (``mtp-gateway sim --engine vllm``): the SGLang simulator's
engine core (speed, virtual time, memory ledger) behind vLLM's own bytes.

- formats.py: chat and completions chunks, non-stream bodies, the nested error, the Messages
  events as vLLM converts its chat stream;
- generation.py: the generation endpoints (chat, completions, messages, responses);
- sleep.py: sleep mode (``/sleep``, ``/wake_up``, ``/is_sleeping``, dev mode only) on the
  shared device's ledger, with its costs and failures;
- app.py: the routes, /v1/models, /health, /ping, /version and /metrics (``vllm:*`` names).

Source lines (file:line under ``vllm/`` in the 0.33.0 wheel) are in docs/compat.md's vLLM
section, one row per behaviour, and next to the code that follows them. Nothing here changes
the SGLang simulator's paths.
"""
