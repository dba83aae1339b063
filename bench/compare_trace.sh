#!/usr/bin/env bash
# kvmesh compare on the Mooncake FAST'25 conversation trace (issue 2's closing note).
# 600 requests span ~176 model seconds; --time-scale 2 replays them in ~90 s per policy.
# Prompts are capped at --max-input-tokens (default 16384) to stay feasible on 2 cores;
# engines get 2048 blocks of 64 tokens each by default with --trace.
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/traces/conversation_trace.jsonl}
exec .venv/bin/kvmesh compare --trace "$TRACE" --requests 600 --time-scale 2 \
  --json-out bench/compare_trace.json "$@"
