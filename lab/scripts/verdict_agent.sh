#!/usr/bin/env bash
# The verdict on agent sessions (issue 27): the `agent` workload at fixed numbers of sessions and
# over a day, one hardware profile, the split and the turns pair against every single server.
# Usage: lab/scripts/verdict_agent.sh HARDWARE OUT_DIR
set -euo pipefail
hw="$1"; out="$2"
targets=(--target gateway --target pair-turns --target single-plain --target single-mtp
         --target single-adaptive --target single-mtp-tuned --target single-adaptive-tuned)
mtp-gateway bench --sim --hardware "$hw" --workload agent --concurrency 4,16,64 --duration 300 \
  "${targets[@]}" --no-progress --json "$out/agent-levels-$hw.json" > "$out/agent-levels-$hw.md"
mtp-gateway bench --sim --hardware "$hw" --workload agent --schedule 4:300,16:300,64:300,32:300,4:300 \
  "${targets[@]}" --no-progress --json "$out/agent-day-$hw.json" > "$out/agent-day-$hw.md"
