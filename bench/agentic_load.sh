#!/usr/bin/env bash
# Issue 9: agentic coding sessions (kv-cache-tester traces, closed loop) on 8 simulated engines whose KV
# pools (8 x 1,024 blocks of 64 tokens) cannot hold every live session (48 at once, ~12k tokens each),
# kvmesh's policies beside the peer routers over the same engines (`make peers-env`), then a load sweep
# for goodput at a TTFT-p90 SLO. Figures: docs/BENCHMARKS.md, "Agentic sessions at load".
#   bench/agentic_load.sh point   [extra compare flags]   # one load, every policy and peer
#   bench/agentic_load.sh sweep   [extra compare flags]   # rate scales, round-robin vs precise-prefix
#   bench/agentic_load.sh steady  [extra compare flags]   # sessions arriving over time (issue 9, wave 7)
# Columns name their engines' KV offload (vLLM's OffloadingConnector, simulated): NAME+cpu, NAME+cpu+kv_store,
# plain NAME = --offload (off). The point run puts round-robin without offload (the plain Kubernetes Service of
# llm-d's headline) beside prefix routing with CPU offload, and round-robin with offload too; POLICIES, PEERS,
# SESSIONS, REQUESTS, RATE_SCALE, BLOCKS override (e.g. POLICIES=round-robin,precise-prefix+cpu PEERS='').
# Prompts are the trace's at 8 tokens per 64-token hash block (--block-tokens), capped at 24,576 tokens;
# outputs capped at 64 tokens (streaming cost on 2 cores); --time-scale 0.5 halves the mesh's own Python
# overhead in model time. JSON goes to .run/bench/, the sweep plot to docs/img/agentic_sweep.png.
# Issue 9's headline (target regime: round-robin TTFT p50 >= 2 s; llm-d-blend = precise-prefix without its
# sticky-session margin):  REQUESTS=640 SESSIONS=100 RATE_SCALE=20 \
#   POLICIES=round-robin,llm-d-blend+cpu,precise-prefix+cpu,tier-cost+cpu PEERS=vllm-router-cache-aware+cpu \
#   bench/agentic_load.sh point --block-tokens 16
# `steady` is the same comparison with sessions arriving over time instead of all at once: 960 calls of 100
# sessions starting 2 model s apart on average (0.17 s after RATE_SCALE=12), so the run measures a pool serving
# a stream of agent sessions rather than 100 cold first calls queued together (round-robin's TTFT p50 ~2 s).
# LONG_PREFILL=N gives every engine vLLM 0.32's --long-prefill-token-threshold N (a long prefill then shares each
# step with newer requests instead of running to its end first; off by default, as in vLLM), LONG_PREFILL_ADAPTIVE=1
# adds --long-prefill-token-threshold-adaptive (the cap floored at 2048 / (running + waiting)); the JSON records
# both under "engine_scheduler". A/B on the steady regime: the same command with and without, e.g.
#   LONG_PREFILL=512 bench/agentic_load.sh steady --json-out .run/bench/agentic_steady_lp512.json
# RESERVE_FULL_ISL=1 (or 0) passes --scheduler-reserve-full-isl (--no-...): vLLM 0.32 admits a waiting request only
# when its whole prompt's KV blocks are free (its default, and the simulator's); 0 gives first-chunk admission.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .run/bench docs/img
MODE=${1:-point}; shift || true
TRACE=${TRACE:-../shared/data/traces/kv-cache-tester_agentic_traces_first100.tar.gz}
COMMON=(--trace "$TRACE" --engines 8 --num-gpu-blocks "${BLOCKS:-1024}" --requests "${REQUESTS:-480}" --session-gap 0.5
        --sessions "${SESSIONS:-48}" --time-scale 0.5 --max-output-tokens 64 --slo-ttft 2)
if [[ -n "${LONG_PREFILL:-}" ]]; then COMMON+=(--long-prefill-token-threshold "$LONG_PREFILL"); fi
if [[ "${LONG_PREFILL_ADAPTIVE:-0}" == 1 ]]; then COMMON+=(--long-prefill-token-threshold-adaptive); fi
case "${RESERVE_FULL_ISL:-}" in
  1) COMMON+=(--scheduler-reserve-full-isl) ;;
  0) COMMON+=(--no-scheduler-reserve-full-isl) ;;
esac
case "$MODE" in
  point)
    exec .venv/bin/kvmesh compare "${COMMON[@]}" --rate-scale "${RATE_SCALE:-10}" \
      --policies "${POLICIES:-round-robin,round-robin+cpu,precise-prefix+cpu,tier-cost+cpu}" \
      --peers "${PEERS-sglang-router+cpu,vllm-router-cache-aware+cpu}" \
      --json-out .run/bench/agentic_point.json --plot .run/bench/agentic_point.png "$@" ;;
  steady)
    exec .venv/bin/kvmesh compare "${COMMON[@]}" --requests "${REQUESTS:-960}" --sessions "${SESSIONS:-100}" \
      --session-gap "${GAP:-2}" --block-tokens 16 --rate-scale "${RATE_SCALE:-12}" \
      --policies "${POLICIES:-round-robin,precise-prefix+cpu}" --peers "${PEERS-vllm-router-cache-aware+cpu}" \
      --json-out .run/bench/agentic_steady.json --plot .run/bench/agentic_steady.png "$@" ;;
  sweep)
    exec .venv/bin/kvmesh compare "${COMMON[@]}" --policies "${POLICIES:-round-robin,precise-prefix+cpu}" \
      --sweep "${SCALES:-2,5,10}" --json-out .run/bench/agentic_sweep.json --plot docs/img/agentic_sweep.png "$@" ;;
  *) echo "usage: $0 point|sweep|steady [compare flags]" >&2; exit 2 ;;
esac
