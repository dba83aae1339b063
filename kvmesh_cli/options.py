"""The typer option types shared by the ``kvmesh`` commands (flags, help text, bounds)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from engine_simulator.config import SimulatorConfig
from kvmesh_cli.workloads import (
    BUILTIN_WORKLOADS,
    DEFAULT_AGENTIC_BLOCKS,
    DEFAULT_MAX_INPUT_TOKENS,
    DEFAULT_NUM_GPU_BLOCKS,
    DEFAULT_TRACE_NUM_GPU_BLOCKS,
)

SIMULATOR_DEFAULTS = SimulatorConfig.model_construct()
"""The engine simulator's own defaults (read, never restated: a flag left unset passes nothing)."""


def simulator_bound(field: str, kind: str) -> float | None:
    """The engine simulator's own bound ``kind`` (``ge``, ``gt``, ``le``, ``lt``) on config ``field``, or None;
    the CLI's limits are read from here (one source of truth) so a value the CLI accepts also starts the engines."""
    for item in SimulatorConfig.model_fields[field].metadata:
        value = getattr(item, kind, None)
        if value is not None:
            return float(value)
    return None


def _int_bound(field: str, kind: str) -> int | None:
    value = simulator_bound(field, kind)
    return None if value is None else int(value)


MIN_NUM_GPU_BLOCKS = _int_bound("num_gpu_blocks", "ge") or 2
"""The fewest KV blocks an engine takes (one is vLLM's null block)."""
MAX_BLOCK_SIZE_TOKENS = _int_bound("block_size_tokens", "le")
MAX_TIME_SCALE = simulator_bound("time_scale", "le")
"""The simulator's cap on ``--time-scale`` (10000)."""


def check_model_name(value: str | None) -> str | None:
    """``--model``: None (unset) or a non-blank name.

    Raises:
        typer.BadParameter: an empty or blank name (it would silently mean the default).
    """
    if value is not None and not value.strip():
        raise typer.BadParameter("the model name is empty; leave --model out for the default")
    return value


def check_etcd_address(value: str | None) -> str | None:
    """``--etcd``: None (unset) or ``host:port`` with a port 1-65535, checked as the option is parsed, so a
    malformed one is a usage error (exit 2) before anything starts (no run folder, no etcd).

    Raises:
        typer.BadParameter: not ``host:port`` (a URL, no port, a port that is no integer or out of range).
    """
    if value is None:
        return None
    from kvmesh_cli.discovery import split_host_port  # grpc: imported only when the option is given

    try:
        split_host_port(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--etcd") from None
    return value


EnginesOpt = Annotated[int, typer.Option("--engines", min=1, help="Number of simulated engines.")]
EtcdOpt = Annotated[
    str | None, typer.Option("--etcd", callback=check_etcd_address,
                             help="host:port of an existing etcd; default: start a local one.")
]
TimeScaleOpt = Annotated[
    float,
    typer.Option("--time-scale", min=0.01, max=MAX_TIME_SCALE, help="Simulated time runs this many times faster than wall time "
                 "(engines and arrivals); reported times are in model seconds."),
]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Logs and etcd data; default .run/<cmd>-<time>.")]
_CONTEXT_CAP_HELP = (" It also caps each simulated engine's context length (max_model_len) at (blocks - 1) x "
                     "block size: 64 blocks of 64 tokens = 4,032 tokens, and a longer request gets a 400 "
                     "context-length error (`kvmesh replay --workload agentic` needs ~768 blocks).")
BlocksOpt = Annotated[int, typer.Option("--num-gpu-blocks", min=MIN_NUM_GPU_BLOCKS,
                                        help="KV-cache blocks per engine." + _CONTEXT_CAP_HELP)]
AutoBlocksOpt = Annotated[
    int | None,
    typer.Option("--num-gpu-blocks", min=MIN_NUM_GPU_BLOCKS,
                 help=f"KV-cache blocks per engine (default {DEFAULT_NUM_GPU_BLOCKS} for multi-turn, "
                      f"{DEFAULT_AGENTIC_BLOCKS} for agentic workloads, {DEFAULT_TRACE_NUM_GPU_BLOCKS} with a "
                      "Mooncake --trace)." + _CONTEXT_CAP_HELP),
]
BlockSizeOpt = Annotated[
    int | None,
    typer.Option("--block-size-tokens", min=1, max=MAX_BLOCK_SIZE_TOKENS,
                 help=f"Tokens per KV block (default: the simulator's, {SIMULATOR_DEFAULTS.block_size_tokens}).")]
MaxSeqsOpt = Annotated[
    int | None,
    typer.Option("--max-num-seqs", min=1,
                 help=f"Concurrent sequences per engine (default: the simulator's, {SIMULATOR_DEFAULTS.max_num_seqs}).")]
ModelOpt = Annotated[str, typer.Option("--model", help="Served model name of the engines.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO.")]
TraceOpt = Annotated[
    Path | None,
    typer.Option("--trace", exists=True, dir_okay=True,
                 help="Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids of 512-token "
                      "blocks), or kv-cache-tester agentic traces (.tar.gz, a directory of .json, one .json; replayed "
                      "as closed-loop sessions). Each hash id becomes a deterministic block of token ids."),
]
WorkloadOpt = Annotated[
    str, typer.Option("--workload", help=f"Built-in workload when no --trace: {', '.join(BUILTIN_WORKLOADS)}.")
]
RequestsOpt = Annotated[int, typer.Option("--requests", min=1, help="Number of requests (first N of a trace).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the workload generator and of prompt tokens.")]
MaxInOpt = Annotated[
    int | None,
    typer.Option("--max-input-tokens", min=1,
                 help=f"Truncate prompts to this many tokens, keeping their prefix (default for --trace: "
                      f"{DEFAULT_MAX_INPUT_TOKENS}; the multi-turn workload is shorter already)."),
]
MaxOutOpt = Annotated[
    int, typer.Option("--max-output-tokens", min=1, help="Cap on max_tokens per request.")
]
ConcurrencyOpt = Annotated[
    int, typer.Option("--concurrency-limit", min=1, help="Most requests in flight at once.")
]
JsonOutOpt = Annotated[Path | None, typer.Option("--json-out", help="Write the results as JSON here.")]
RateScaleOpt = Annotated[
    float,
    typer.Option("--rate-scale", min=0.001, help="Offer the workload this many times faster (model time): open-loop "
                 "arrivals and closed-loop session starts and think times divided by it."),
]
SessionsOpt = Annotated[
    int | None,
    typer.Option("--sessions", min=1, help="Closed-loop concurrency: at most this many sessions live at once (a "
                 "session's first call waits for a slot); default for compare on agentic workloads: 4 per engine, "
                 "else none (sessions start on their own schedule)."),
]
SloTtftOpt = Annotated[
    float, typer.Option("--slo-ttft", min=0.0, help="TTFT SLO in model seconds for goodput (requests/s within it).")
]
BlockTokensOpt = Annotated[
    int,
    typer.Option("--block-tokens", min=1, help="Agentic traces: tokens each 64-token trace hash block becomes "
                 "(default 8: prompts an eighth of their recorded length, sharing kept)."),
]
SessionGapOpt = Annotated[
    float, typer.Option("--session-gap", min=0.0, help="Agentic: mean gap between session starts (model s).")
]
MaxThinkOpt = Annotated[
    float, typer.Option("--max-think", min=0.0, help="Agentic: cap on a recorded think time (model s).")
]
LongPrefillOpt = Annotated[
    int | None,
    typer.Option("--long-prefill-token-threshold", min=0,
                 help="vLLM's --long-prefill-token-threshold for every engine (simulated or real): while more than "
                      "one request is running or waiting, none gets more than this many tokens per step, so a long "
                      "prefill shares the step with newer requests (warm follow-ups start at once); a lone request "
                      f"is not capped. 0 disables it (default: the engine's, "
                      f"{SIMULATOR_DEFAULTS.long_prefill_token_threshold}, as vLLM 0.32's).")]
LongPrefillAdaptiveOpt = Annotated[
    bool,
    typer.Option("--long-prefill-token-threshold-adaptive",
                 help="vLLM's --long-prefill-token-threshold-adaptive for every engine: raise that cap to a fair "
                      "share of the step, max-num-batched-tokens / (running + waiting requests). Needs a non-zero "
                      "--long-prefill-token-threshold.")]
ReserveFullIslOpt = Annotated[
    bool | None,
    typer.Option("--scheduler-reserve-full-isl/--no-scheduler-reserve-full-isl",
                 help="vLLM's --scheduler-reserve-full-isl for every engine: admit a waiting request only when the KV "
                      "blocks of its whole prompt are free, not only its first chunk's (default: the engine's; vLLM "
                      f"0.32: on, the simulator: {'on' if SIMULATOR_DEFAULTS.scheduler_reserve_full_isl else 'off'}).")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="KVMESH_API_KEY",
                 help="Client API key sent to the router (Authorization: Bearer) when it requires one (tenants with "
                      "require_api_key), by the readiness check and the replay; default: $KVMESH_API_KEY, or for a "
                      "mesh the command starts a key from $KVMESH_ROUTER_TENANTS.")]
UpApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="KVMESH_API_KEY",
                 help="Client API key the router accepts (tenants with require_api_key): sent by the readiness check "
                      "and put in the printed curl and replay commands (Authorization: Bearer); default: "
                      "$KVMESH_API_KEY, else the first key of $KVMESH_ROUTER_TENANTS.")]
