#!/usr/bin/env bash
# The verdict on a public trace replayed open-loop (issue 27): Mooncake's FAST'25
# conversation trace (kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl,
# blob 5a371794b81d), its first 3,000 requests (the first ~16.5 minutes of the trace), at three
# slowdowns, on both hardware profiles, the split pair and the turns pair against every single
# server. Usage: lab/scripts/verdict_trace.sh TRACE.jsonl OUT_DIR
set -euo pipefail
trace="$1"; out="$2"
head -3000 "$trace" > "$out/conversation-3000.jsonl.tmp"
for hw in rtx-pro-6000 h200; do
  for slow in 2 4 8; do
    mtp-gateway bench --sim --hardware "$hw" --trace "$out/conversation-3000.jsonl.tmp" \
      --trace-format mooncake --trace-time-scale "$slow" \
      --target gateway --target pair-turns --target single-plain --target single-mtp \
      --target single-adaptive --target single-mtp-tuned --target single-adaptive-tuned \
      --no-progress --json "$out/trace-conversation-$hw-x$slow.json" > "$out/trace-conversation-$hw-x$slow.md"
  done
done
rm "$out/conversation-3000.jsonl.tmp"
