"""The ``kvmesh`` command: ``up``, ``replay`` and ``compare``.

- ``kvmesh up`` starts a whole mesh in the foreground (etcd, the five services, N simulated
  engines), prints where everything listens, and stops it all on Ctrl-C or SIGTERM.
- ``kvmesh replay`` sends a workload (a Mooncake trace or a built-in generator) through a router,
  either one given with ``--router`` or a mesh it starts itself, and prints TTFT, end-to-end
  latency, throughput and the prefix-cache hit rate measured at the engines.
- ``kvmesh compare`` (what ``make run`` calls) replays the same workload against a fresh mesh per
  routing policy and prints the policies side by side.

All times are reported in *model* seconds: the engines' simulated clock runs ``--time-scale``
times faster than the wall clock, arrivals are replayed that much faster, and measured wall
times are multiplied back.

Defaults of ``compare`` (chosen so ``make run`` finishes in well under 6 minutes on 2 cores and
shows the effect of prefix-aware routing): 4 engines of 64-token blocks with only
``DEFAULT_NUM_GPU_BLOCKS`` blocks each (each engine can hold about a quarter of the workload's
live conversations, so round-robin, which spreads every conversation over all engines, keeps
evicting; precise-prefix keeps each conversation on one engine, whose cache then holds it), the
built-in ``multi-turn`` workload with ``DEFAULT_REQUESTS`` requests (~44 model seconds of arrivals),
and ``--time-scale`` ``DEFAULT_TIME_SCALE`` (1.0: faster replays multiply the mesh's own Python
overhead into model time and load the 2 cores harder). One policy takes ~6 s to start and ~50 s
to replay on 2 cores, so ``make run`` takes about 2 minutes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Annotated

import grpc
import httpx
import typer
from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvmesh.cli.checks import check_router_url, fail, mesh_errors, probe_router, resolve_policy
from kvmesh.cli.mesh import DEFAULT_MODEL, Mesh, MeshSpec, exit_on_signals
from kvmesh.cli.replay import ReplayOutcome, engines_from_epp, engines_from_etcd, replay
from kvmesh.cli.report import (
    RequestResult,
    compare_document,
    fmt,
    hit_rate,
    per_engine,
    summarize,
    summary_table,
    usage_cached_fraction,
)
from kvmesh.cli.workloads import (
    BUILTIN_WORKLOADS,
    Workload,
    builtin_workload,
    cap_workload,
    mooncake_workload,
    read_mooncake,
    workload_stats,
)

DEFAULT_ENGINES = 4
DEFAULT_NUM_GPU_BLOCKS = 384
"""Per engine, 64-token blocks (24.6k tokens): too few for every live conversation, enough for a quarter."""
DEFAULT_TRACE_NUM_GPU_BLOCKS = 2048
"""Per engine with --trace: 131k tokens, about ten capped Mooncake prompts."""
DEFAULT_REQUESTS = 240
DEFAULT_TIME_SCALE = 1.0
DEFAULT_CONCURRENCY = 64
DEFAULT_MAX_INPUT_TOKENS = 16384
"""Mooncake prompts are capped to this (prefixes kept): 2 cores cannot move 100k-token prompts fast."""
DEFAULT_MAX_OUTPUT_TOKENS = 512

app = typer.Typer(
    help="kvmesh: run a local mesh with simulated engines, replay workloads, compare routing policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()


def _default_run_dir(command: str) -> Path:
    return Path(".run") / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# --- shared options ---------------------------------------------------------------------------

EnginesOpt = Annotated[int, typer.Option("--engines", min=1, help="Number of simulated engines.")]
EtcdOpt = Annotated[
    str | None, typer.Option("--etcd", help="host:port of an existing etcd; default: start a local one.")
]
TimeScaleOpt = Annotated[
    float,
    typer.Option("--time-scale", min=0.01, help="Simulated time runs this many times faster than wall time "
                 "(engines and arrivals); reported times are in model seconds."),
]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Logs and etcd data; default .run/<cmd>-<time>.")]
BlocksOpt = Annotated[int, typer.Option("--num-gpu-blocks", min=1, help="KV-cache blocks per engine.")]
AutoBlocksOpt = Annotated[
    int | None,
    typer.Option("--num-gpu-blocks", min=2,
                 help=f"KV-cache blocks per engine (default {DEFAULT_NUM_GPU_BLOCKS} for built-in workloads, "
                      f"{DEFAULT_TRACE_NUM_GPU_BLOCKS} with --trace)."),
]
BlockSizeOpt = Annotated[int, typer.Option("--block-size-tokens", min=1, help="Tokens per KV block.")]
MaxSeqsOpt = Annotated[int, typer.Option("--max-num-seqs", min=1, help="Concurrent sequences per engine.")]
ModelOpt = Annotated[str, typer.Option("--model", help="Served model name of the engines.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Log at INFO.")]
TraceOpt = Annotated[
    Path | None,
    typer.Option("--trace", exists=True, dir_okay=False,
                 help="Mooncake trace (JSONL: timestamp ms, input_length, output_length, hash_ids of 512-token "
                      "blocks). Each hash id becomes a deterministic block of token ids."),
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


def build_workload(
    trace: Path | None, workload: str, requests: int, seed: int, max_input_tokens: int | None, max_output_tokens: int
) -> Workload:
    """The workload a replay/compare sends (see :mod:`kvmesh.cli.workloads`).

    Raises:
        typer.BadParameter: an unknown built-in workload, or a trace that is not a Mooncake trace
            (the message names the file and line).
    """
    if trace is not None:
        try:
            rows = read_mooncake(trace, limit=requests)
            if not rows:
                raise ValueError(f"{trace}: no trace rows")
            return mooncake_workload(
                rows, seed=seed, max_input_tokens=max_input_tokens or DEFAULT_MAX_INPUT_TOKENS,
                max_output_tokens=max_output_tokens,
            )
        except UnicodeDecodeError as exc:
            raise typer.BadParameter(f"{trace}: not UTF-8 text ({exc.reason} at byte {exc.start})",
                                     param_hint="--trace") from None
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--trace") from None
    try:
        wl = builtin_workload(workload, requests, seed)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload") from exc
    return cap_workload(wl, max_input_tokens, max_output_tokens)


def _default_blocks(trace: Path | None) -> int:
    return DEFAULT_TRACE_NUM_GPU_BLOCKS if trace is not None else DEFAULT_NUM_GPU_BLOCKS


def _workload_line(wl: Workload, label: str) -> str:
    st = workload_stats(wl)
    return (f"workload {label}: {st['requests']} requests over {st.get('span_s', 0):.1f} model s, "
            f"prompt mean {st.get('input_tokens_mean', 0):.0f} / max {st.get('input_tokens_max', 0)} tokens, "
            f"output mean {st.get('output_tokens_mean', 0):.0f} tokens")


def _run_replay(
    wl: Workload, router_url: str, engine_urls: list[str], time_scale: float, concurrency: int,
    model: str | None, label: str,
) -> ReplayOutcome:
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("errors {task.fields[errors]}"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        task = progress.add_task(label, total=len(wl.requests), errors=0)
        errors = 0

        def on_done(res: RequestResult) -> None:
            nonlocal errors
            errors += 0 if res.ok else 1
            progress.update(task, advance=1, errors=errors)

        try:
            return asyncio.run(replay(
                wl, router_url=router_url, engine_urls=engine_urls, time_scale=time_scale,
                concurrency_limit=concurrency, model=model, on_done=on_done,
            ))
        except httpx.HTTPError as exc:  # discovering the model; requests themselves never raise
            progress.stop()
            fail(f"router {router_url}: {type(exc).__name__}: {exc}")
        except RuntimeError as exc:  # the router lists no model
            progress.stop()
            fail(str(exc))


def _summary(outcome: ReplayOutcome, time_scale: float) -> dict[str, object]:
    return summarize(
        outcome.results, wall_duration_s=outcome.wall_duration_s, time_scale=time_scale,
        prefix_hit_rate=hit_rate(outcome.counters_before, outcome.counters_after),
    )


def _engine_line(outcome: ReplayOutcome) -> None:
    parts = [f"{url.rsplit(':', 1)[-1]}: {n} req, {fmt(rate, 'pct')} hits"
             for url, (n, rate) in sorted(per_engine(outcome.counters_before, outcome.counters_after).items())]
    if parts:
        console.print("engines (port): " + "; ".join(parts), soft_wrap=True)


def _first_errors(outcome: ReplayOutcome, n: int = 3) -> None:
    bad = [r for r in outcome.results if not r.ok]
    for r in bad[:n]:
        console.print(f"[red]request {r.index} failed:[/red] {r.error}", soft_wrap=True)


# --- up ---------------------------------------------------------------------------------------


def mesh_table(mesh: Mesh) -> Table:
    """Where each member listens; addresses never wrap (only the log path folds, on a narrow terminal)."""
    table = Table(title=f"kvmesh: {mesh.spec.engines} engines, policy {mesh.spec.policy}")
    for col in ("service", "pid", "gRPC", "HTTP", "metrics"):
        table.add_column(col, no_wrap=True)
    table.add_column("log", overflow="fold")
    for row in mesh.describe():
        table.add_row(row["service"], row["pid"], row["grpc"], row["http"], row["metrics"], row["log"])
    return table


def print_table(out: Console, table: Table) -> None:
    """Print ``table`` whole: when ``out`` is not a terminal (piped, 80 columns by default) as wide as it needs."""
    if out.is_terminal:
        out.print(table)
        return
    width = out.width
    out.width = max(width, Measurement.get(out, out.options.update(width=10_000), table).maximum)
    try:
        out.print(table, crop=False)
    finally:
        out.width = width


def ready_lines(mesh: Mesh) -> list[str]:
    """The ``kvmesh ready`` line (router URL is its 4th word) and how to replay against this mesh."""
    return [
        (f"kvmesh ready: router {mesh.router_url} model {mesh.spec.model} epp {mesh.epp_address} "
         f"etcd {mesh.etcd_address} (Ctrl-C to stop)"),
        f"replay against it: kvmesh replay --router {mesh.router_url} --epp {mesh.epp_address}",
    ]


@app.command()
def up(
    engines: EnginesOpt = DEFAULT_ENGINES,
    policy: Annotated[str, typer.Option("--policy", help="epp scheduling config: round-robin, load-only, "
                                        "precise-prefix or a YAML path.")] = "precise-prefix",
    etcd: EtcdOpt = None,
    time_scale: TimeScaleOpt = 1.0,
    run_dir: RunDirOpt = None,
    num_gpu_blocks: BlocksOpt = 2048,
    block_size_tokens: Annotated[int | None, typer.Option(
        "--block-size-tokens", min=1, help="Tokens per KV block (default 64; 32 with --engine vllm, "
        "whose CPU attention needs a multiple of 32).")] = None,
    max_num_seqs: MaxSeqsOpt = 64,
    model: Annotated[str | None, typer.Option("--model", help=f"Served model name of the engines (default "
                                              f"{DEFAULT_MODEL}; tiny with --engine vllm).")] = None,
    router_port: Annotated[int | None, typer.Option("--router-port", help="Router HTTP port (default: free).")] = None,
    router_grpc_port: Annotated[int | None, typer.Option("--router-grpc-port", help="Router gRPC port.")] = None,
    engine: Annotated[str, typer.Option(
        "--engine", help="simulator (default) or vllm: real vLLM CPU servers on the tiny model, each with a "
        "registration sidecar (needs `make vllm-env model`; ~30-60 s to start, ~3 GB RAM and 2 cores each). "
        "--time-scale and --num-gpu-blocks apply to the simulator only.")] = "simulator",
    verbose: VerboseOpt = False,
) -> None:
    """Start etcd, the five services and N engines (simulated, or real vLLM) in the foreground; Ctrl-C stops all."""
    _setup_logging(verbose)
    extra: dict[str, object] = {}
    if engine == "vllm":
        from kvmesh.cli.vllm_engine import VLLM_BLOCK_SIZE_TOKENS, VLLM_MODEL, vllm_missing_reason

        missing = vllm_missing_reason()
        if missing:
            raise typer.BadParameter(missing, param_hint="--engine")
        block_size_tokens = block_size_tokens or VLLM_BLOCK_SIZE_TOKENS
        if block_size_tokens % 32:
            raise typer.BadParameter("vLLM's CPU attention needs a multiple of 32", param_hint="--block-size-tokens")
        model = model or VLLM_MODEL
        extra = {"engine": "vllm", "max_model_len": 2048, "start_timeout_seconds": 120.0 + 60.0 * engines}
    elif engine != "simulator":
        raise typer.BadParameter(f"{engine!r}: expected simulator or vllm", param_hint="--engine")
    policy = resolve_policy(policy)
    spec = MeshSpec(
        run_dir=(run_dir or _default_run_dir("up")).resolve(), engines=engines, policy=policy,
        time_scale=time_scale, model=model or DEFAULT_MODEL, num_gpu_blocks=num_gpu_blocks,
        block_size_tokens=block_size_tokens or 64, max_num_seqs=max_num_seqs, etcd=etcd,
        router_http_port=router_port, router_grpc_port=router_grpc_port, **extra,  # type: ignore[arg-type]
    )
    console.print(f"starting mesh in {spec.run_dir} ...", soft_wrap=True)
    with exit_on_signals(), mesh_errors():
        try:
            with Mesh(spec) as mesh:
                print_table(console, mesh_table(mesh))
                for line in ready_lines(mesh):
                    console.print(line, soft_wrap=True, markup=False, highlight=False)
                dead: set[str] = set()
                while True:
                    time.sleep(0.5)
                    for m in mesh.members:
                        if m.name not in dead and not m.process.alive():
                            dead.add(m.name)
                            console.print(f"[red]{m.name} exited[/red]; log {m.log_path}", soft_wrap=True)
        except KeyboardInterrupt:
            console.print("stopping mesh ...")
    console.print("kvmesh stopped")


# --- replay -----------------------------------------------------------------------------------


@app.command("replay")
def replay_cmd(
    router: Annotated[str | None, typer.Option("--router", help="Router base URL, e.g. http://127.0.0.1:8000; "
                                               "default: start a mesh for this replay.")] = None,
    epp: Annotated[str | None, typer.Option("--epp", help="epp gRPC host:port, to find the engines to scrape "
                                            "(with --router).")] = None,
    etcd: EtcdOpt = None,
    trace: TraceOpt = None,
    workload: WorkloadOpt = "multi-turn",
    requests: RequestsOpt = 100,
    seed: SeedOpt = 0,
    time_scale: TimeScaleOpt = 1.0,
    concurrency_limit: ConcurrencyOpt = DEFAULT_CONCURRENCY,
    max_input_tokens: MaxInOpt = None,
    max_output_tokens: MaxOutOpt = DEFAULT_MAX_OUTPUT_TOKENS,
    json_out: JsonOutOpt = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name; default: the router's first.")] = None,
    engines: EnginesOpt = DEFAULT_ENGINES,
    policy: Annotated[str, typer.Option("--policy", help="Policy of the mesh started without --router.")] =
        "precise-prefix",
    num_gpu_blocks: AutoBlocksOpt = None,
    run_dir: RunDirOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Send a workload through the router and report TTFT, latency, throughput and prefix-cache hits.

    With --router, the engines whose /metrics are scraped for the hit rate come from --epp
    (ListEndpoints) or --etcd; --time-scale must then match the engines' own. Without --router, a
    mesh with --engines/--policy/--num-gpu-blocks is started for the replay and stopped after.
    """
    _setup_logging(verbose)
    if router is not None:
        router = check_router_url(router)
    else:
        policy = resolve_policy(policy)
    wl = build_workload(trace, workload, requests, seed, max_input_tokens, max_output_tokens)
    label = trace.name if trace else workload
    num_gpu_blocks = num_gpu_blocks or _default_blocks(trace)
    console.print(_workload_line(wl, label), soft_wrap=True)
    if router is not None:
        probe_router(router)
        if epp:
            try:
                engine_urls = engines_from_epp(epp)
            except grpc.RpcError as exc:
                fail(f"cannot list the engines from epp {epp}: {exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
        elif etcd:
            engine_urls = asyncio.run(engines_from_etcd(etcd))
            if not engine_urls:
                console.print(f"no engines registered in etcd {etcd}: the engine prefix-cache hit rate is not "
                              "measured", soft_wrap=True)
        else:
            engine_urls = []
            console.print("no --epp/--etcd: the engine prefix-cache hit rate is not measured", soft_wrap=True)
        outcome = _run_replay(wl, router, engine_urls, time_scale, concurrency_limit, model, label)
        column = router
    else:
        spec = MeshSpec(run_dir=(run_dir or _default_run_dir("replay")).resolve(), engines=engines, policy=policy,
                        time_scale=time_scale, num_gpu_blocks=num_gpu_blocks, etcd=etcd)
        with exit_on_signals(), mesh_errors(), Mesh(spec) as mesh:
            outcome = _run_replay(wl, mesh.router_url, mesh.engine_urls, time_scale, concurrency_limit, model, label)
        column = policy
    summary = _summary(outcome, time_scale)
    _first_errors(outcome)
    _engine_line(outcome)
    console.print(summary_table({column: summary}, f"replay of {label}"))
    cached = usage_cached_fraction(outcome.results)
    if cached is not None:
        console.print(f"cached prompt tokens reported in usage: {100 * cached:.1f} %")
    if json_out is not None:
        doc = {"workload": label, "requests": len(wl.requests), "time_scale": time_scale, **summary}
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {json_out}")


# --- compare ----------------------------------------------------------------------------------


def write_plot(doc: dict[str, object], path: Path) -> bool:
    """Bar charts of TTFT p50/p90, e2e p50, output tokens/s and hit rate per policy; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    policies: dict[str, dict[str, float | None]] = doc["policies"]  # type: ignore[assignment]
    names = list(policies)
    panels = [
        ("TTFT p50 (model s)", "ttft_p50_s", 1.0), ("TTFT p90 (model s)", "ttft_p90_s", 1.0),
        ("e2e p50 (model s)", "e2e_p50_s", 1.0), ("output tokens/s", "output_tokens_per_s", 1.0),
        ("prefix-cache hit rate (%)", "prefix_hit_rate", 100.0),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (title, key, mult) in zip(axes, panels, strict=True):
        vals = [(policies[n].get(key) or 0.0) * mult for n in names]
        ax.bar(names, vals, color=["#888888", "#2a7ab9", "#d9822b", "#3a9e5c"][: len(names)])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"{doc['workload']}: {doc['requests']} requests, {doc['engines']} engines")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


@app.command()
def compare(
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated epp scheduling configs.")] =
        "round-robin,precise-prefix",
    trace: TraceOpt = None,
    workload: WorkloadOpt = "multi-turn",
    requests: RequestsOpt = DEFAULT_REQUESTS,
    seed: SeedOpt = 0,
    engines: EnginesOpt = DEFAULT_ENGINES,
    num_gpu_blocks: AutoBlocksOpt = None,
    block_size_tokens: BlockSizeOpt = 64,
    max_num_seqs: MaxSeqsOpt = 64,
    time_scale: TimeScaleOpt = DEFAULT_TIME_SCALE,
    concurrency_limit: ConcurrencyOpt = DEFAULT_CONCURRENCY,
    max_input_tokens: MaxInOpt = None,
    max_output_tokens: MaxOutOpt = DEFAULT_MAX_OUTPUT_TOKENS,
    etcd: EtcdOpt = None,
    run_dir: RunDirOpt = None,
    json_out: JsonOutOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a bar chart PNG (needs matplotlib).")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Replay one workload against a fresh mesh per routing policy and print the policies side by side."""
    _setup_logging(verbose)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    if not names:
        raise typer.BadParameter("no policy given", param_hint="--policies")
    resolved = {name: resolve_policy(name, param_hint="--policies") for name in names}
    wl = build_workload(trace, workload, requests, seed, max_input_tokens, max_output_tokens)
    label = trace.name if trace else workload
    num_gpu_blocks = num_gpu_blocks or _default_blocks(trace)
    base = (run_dir or _default_run_dir("compare")).resolve()
    console.print(_workload_line(wl, label), soft_wrap=True)
    console.print(f"{engines} engines x {num_gpu_blocks} blocks of {block_size_tokens} tokens, time scale "
                  f"{time_scale}, logs in {base}", soft_wrap=True)
    summaries: dict[str, dict[str, object]] = {}
    with exit_on_signals(), mesh_errors():
        for i, name in enumerate(names):
            spec = MeshSpec(
                run_dir=base / f"{i}-{Path(name).stem}", engines=engines, policy=resolved[name],
                time_scale=time_scale,
                num_gpu_blocks=num_gpu_blocks, block_size_tokens=block_size_tokens, max_num_seqs=max_num_seqs,
                etcd=etcd,
            )
            t0 = time.monotonic()
            with Mesh(spec) as mesh:
                console.print(f"[bold]{name}[/bold]: mesh up in {time.monotonic() - t0:.1f}s", soft_wrap=True)
                outcome = _run_replay(wl, mesh.router_url, mesh.engine_urls, time_scale, concurrency_limit, None,
                                      name)
            _first_errors(outcome)
            _engine_line(outcome)
            summaries[name] = _summary(outcome, time_scale)
    doc = compare_document(label, engines, len(wl.requests), summaries)
    console.print(summary_table(doc["policies"], f"{label}: {len(wl.requests)} requests, {engines} engines"))  # type: ignore[arg-type]
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {json_out}")
    if plot is not None:
        if write_plot(doc, plot):
            console.print(f"wrote {plot}")
        else:
            console.print("matplotlib is not installed; no plot (pip install matplotlib)")


if __name__ == "__main__":
    app()
