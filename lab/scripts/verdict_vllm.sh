#!/usr/bin/env bash
# The vLLM verdict (issue 29), in virtual time: the vLLM pair, split and taking turns in sleep mode
# (MTP k=1 as the recipe, and k=2), against each single vLLM server (plain, MTP k=1 and k=2, MTP
# with vLLM issue #49548's dynamic schedule), on the seed and the agent workloads at fixed levels
# and over the agent day (4 -> 16 -> 64 -> 32 -> 4 sessions, 10 minutes each), one hardware
# profile. What the vLLM servers are in the simulator, and what is approximate:
# gateway/sim/vllm/profiles.py; what a vLLM turn costs: gateway/bench/targets.py vllm_turn.
# Usage: lab/scripts/verdict_vllm.sh HARDWARE OUT_DIR
set -euo pipefail
hw="$1"; out="$2"
targets=(--target vllm-pair --target vllm-pair-turns --target vllm-pair-turns-k2 --target vllm-plain
         --target vllm-mtp --target vllm-mtp-k2 --target vllm-mtp-dynamic)
bench() {  # bench NAME ARGS...: the table in $out/vllm-NAME-$hw.md, under the command that made it
  local name="$1"; shift
  { echo "Command: \`mtp-gateway bench $*\` (lab/scripts/verdict_vllm.sh $hw $out)"; echo
    mtp-gateway bench "$@" --json "$out/vllm-$name-$hw.json"; } > "$out/vllm-$name-$hw.md"
}
bench seed --sim --hardware "$hw" --workload seed --concurrency 1,8,32,64,128 "${targets[@]}" --no-progress
bench agent --sim --hardware "$hw" --workload agent --concurrency 4,16,64 --duration 300 "${targets[@]}" \
  --no-progress
bench agent-day --sim --hardware "$hw" --workload agent --schedule 4:600,16:600,64:600,32:600,4:600 \
  "${targets[@]}" --no-progress
