#!/usr/bin/env bash
# kvmesh compare on the Mooncake FAST'25 conversation trace (issue 2's closing note; issue 9's 2x/4x target).
# 600 requests span ~201 model seconds; --time-scale 2 replays them in ~100 s per policy and rate.
# Prompts are capped at --max-input-tokens (default 16384) to stay feasible on 2 cores;
# engines get 2048 blocks of 64 tokens each by default with --trace.
# Issue 9's target ("precise ahead of round-robin on TTFT p50 and p99 at 2x and 4x the native rate") is the
# default: SWEEP=2,4 over round-robin, precise-prefix and tier-cost (~9 min on 2 cores). --timeline writes
# each run's per-engine samples under .run/compare_trace.timeline/ and prints, per run, the engines' load,
# their engine-side TTFT, the router's stage means and the replay client's own loop lag (docs/BENCHMARKS.md).
# SWEEP= (empty) runs the native rate only; pass --parallel on a busy machine (columns share the host's load).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${TRACE:-../shared/data/traces/conversation_trace.jsonl}
SWEEP=${SWEEP-2,4}
POLICIES=${POLICIES:-round-robin,precise-prefix,tier-cost}
exec .venv/bin/kvmesh compare --trace "$TRACE" --requests 600 --time-scale 2 --policies "$POLICIES" \
  ${SWEEP:+--sweep "$SWEEP"} --timeline .run/compare_trace.timeline --json-out .run/compare_trace.json "$@"
