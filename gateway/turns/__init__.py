"""A pair whose two servers take turns owning the GPUs' memory (docs/turns.md).

- `state`: the pair's memory state, a pure state machine (who holds the memory, each step of
  a turn in progress, what a failure leaves, how a restart settles);
- `decision`: when to hand over (vturns);
- the engines' calls are in the engine seam: SGLang 0.5.23's memory saver
  (gateway/upstream/engine/sglang.py, MemorySaver), vLLM 0.33.0's sleep mode
  (gateway/upstream/engine/vllm.py, SleepControl); `state.HANDOVERS` says which steps use them;
- `driver`: the one task per pair that does the I/O the state machine asks for;
- `follow`: a replica that follows another gateway's turns (`turns.controller_url`);
- `waiting`: the arrivals that wait at the gateway while no server admits;
- `wiring`, `metrics`, `nvml`: the assembly, the metrics, the GPUs' free memory.
"""
