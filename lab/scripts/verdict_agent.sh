#!/usr/bin/env bash
# The verdict on agent sessions (issue 27): the `agent` workload at fixed numbers of sessions and
# over a day (4 -> 16 -> 64 -> 32 -> 4 sessions, 10 minutes each), one hardware profile, the split
# and the turns pair against every single server.
# Usage: lab/scripts/verdict_agent.sh HARDWARE OUT_DIR [levels|day]   (default: both)
set -euo pipefail
hw="$1"; out="$2"; what="${3:-both}"
targets=(--target gateway --target pair-turns --target single-plain --target single-mtp
         --target single-adaptive --target single-mtp-tuned --target single-adaptive-tuned)
if [[ "$what" == levels || "$what" == both ]]; then
  mtp-gateway bench --sim --hardware "$hw" --workload agent --concurrency 4,16,64 --duration 300 \
    "${targets[@]}" --no-progress --json "$out/agent-levels-$hw.json" > "$out/agent-levels-$hw.md"
fi
if [[ "$what" == day || "$what" == both ]]; then
  mtp-gateway bench --sim --hardware "$hw" --workload agent --schedule 4:600,16:600,64:600,32:600,4:600 \
    "${targets[@]}" --no-progress --json "$out/agent-day-$hw.json" > "$out/agent-day-$hw.md"
fi
