"""The ``kvmesh`` command: ``up``, ``replay`` and ``compare``.

- ``kvmesh up`` starts a whole mesh in the foreground (etcd, the five services, N simulated
  engines), prints where everything listens, and stops it all on Ctrl-C, SIGINT, SIGTERM or SIGHUP
  (also when started in the background from a script, where the shell sets SIGINT to ignored).
- ``kvmesh replay`` sends a workload (a Mooncake trace or a built-in generator) through a router,
  either one given with ``--router`` or a mesh it starts itself, and prints TTFT, end-to-end
  latency, throughput and the prefix-cache hit rate measured at the engines.
- ``kvmesh compare`` (what ``make run`` calls) replays the same workload against a fresh mesh per
  routing policy and prints the policies side by side.

All times are reported in *model* seconds: the engines' simulated clock runs ``--time-scale``
times faster than the wall clock, arrivals are replayed that much faster, and measured wall
times are multiplied back.

Defaults of ``compare`` (chosen so ``make run`` finishes in under 6 minutes on 2 cores and shows
the effect of prefix-aware routing): the ``agentic`` workload (the kv-cache-tester traces when the
checkout's sibling ``shared/data/traces/`` has them, else sessions generated in their shape), its
first ``DEFAULT_REQUESTS`` calls replayed closed loop at ``DEFAULT_RATE_SCALE`` (think times a
tenth of the recorded ones) with ``DEFAULT_AGENTIC_SESSIONS_PER_ENGINE`` live sessions per engine, on 4 engines of 64-token blocks with ``DEFAULT_AGENTIC_BLOCKS`` each
(about three live sessions per engine, fewer than the sessions live: round-robin, which spreads
every session over all engines, keeps evicting; precise-prefix keeps a session where its history
is), and ``--time-scale`` ``DEFAULT_TIME_SCALE`` (1.0: faster replays multiply the mesh's own
Python overhead into model time). ``--workload multi-turn`` is issue 2's chat workload. ``--peers`` adds
the Rust peer routers (``kvmesh_cli/peers.py``) over the same engines; ``--sweep`` runs every
column at several rate scales and finds each one's goodput at ``--slo-ttft``. ``--timeline DIR``
samples each run's engines, router stages and the client's own loop lag (``kvmesh_cli/timeline.py``:
whether a run measured the routing or a starved host); ``--parallel`` runs a rate's columns at the
same time, each on its own mesh, so that on a busy host they all meet the same load.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ParamSpec, TypeVar

import grpc
import httpx
import typer
from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvmesh_cli.checks import (
    api_key_refusal,
    check_dir_option,
    check_output_file,
    check_router_url,
    err_console,
    fail,
    mesh_errors,
    new_run_dir,
    os_error_text,
    probe_router,
    resolve_policy,
)
from kvmesh_cli.discovery import DiscoveryError, find_engines, split_host_port
from kvmesh_cli.mesh import (
    DEFAULT_MODEL,
    Member,
    Mesh,
    MeshSpec,
    configured_ports,
    exit_on_signals,
    port_clash,
    run_interruptible,
    taken_port,
)
from kvmesh_cli.options import (
    MAX_BLOCK_SIZE_TOKENS,
    SIMULATOR_DEFAULTS,
    ApiKeyOpt,
    AutoBlocksOpt,
    BlockSizeOpt,
    BlocksOpt,
    BlockTokensOpt,
    ConcurrencyOpt,
    EnginesOpt,
    EtcdOpt,
    JsonOutOpt,
    LongPrefillAdaptiveOpt,
    LongPrefillOpt,
    MaxInOpt,
    MaxOutOpt,
    MaxSeqsOpt,
    MaxThinkOpt,
    RateScaleOpt,
    RequestsOpt,
    ReserveFullIslOpt,
    RunDirOpt,
    SeedOpt,
    SessionGapOpt,
    SessionsOpt,
    SloTtftOpt,
    TimeScaleOpt,
    TraceOpt,
    UpApiKeyOpt,
    VerboseOpt,
    WorkloadOpt,
    check_etcd_address,
    check_model_name,
)
from kvmesh_cli.peers import PEERS, peer_missing_reason
from kvmesh_cli.plotting import write_plot, write_sweep_plot
from kvmesh_cli.replay import PROMPT_FORMATS, ReplayOutcome, replay
from kvmesh_cli.report import (
    RequestResult,
    SweepPoint,
    compare_document,
    fmt,
    hit_rate,
    load_split,
    median_summary,
    offload_hit_rate,
    per_engine,
    percentile,
    slo_crossed,
    slo_throughput,
    spread_table,
    stage_means,
    summarize,
    summary_table,
    sweep_table,
    ttft_breakdown,
    usage_cached_fraction,
)
from kvmesh_cli.rundir import sweep_stale_etcd_data
from kvmesh_cli.timeline import EngineSampler, timeline_line, timeline_summary, write_timeline
from kvmesh_cli.workloads import (
    DEFAULT_AGENTIC_ARCHIVE,
    DEFAULT_MAX_OUTPUT_TOKENS,
    AgenticParams,
    Workload,
    WorkloadError,
    default_num_gpu_blocks,
    load_workload,
    oracle_hits,
    scale_load,
    workload_stats,
)

DEFAULT_ENGINES = 4
DEFAULT_REQUESTS = 240
DEFAULT_TIME_SCALE = 1.0
DEFAULT_CONCURRENCY = 64
DEFAULT_WORKLOAD = "agentic"
DEFAULT_RATE_SCALE = 10.0
"""``compare``'s default load: the sessions' recorded think times (and start gaps) a tenth as long."""
DEFAULT_AGENTIC_SESSIONS_PER_ENGINE = 4
"""``compare``'s default ``--sessions`` for agentic workloads, per engine: about a third more live history
than the default pools (:data:`~kvmesh_cli.workloads.DEFAULT_AGENTIC_BLOCKS`) hold."""
DEFAULT_SLO_TTFT_S = 2.0
TIMELINE_INTERVAL_S = 0.5
"""Wall seconds between two samples of ``compare --timeline``."""
OFFLOAD_MODES = ("off", "cpu", "cpu+kv_store")
OffloadOpt = Annotated[str, typer.Option(
    "--offload", help="Simulated engines' KV offload (vLLM's OffloadingConnector): off, cpu (a local CPU tier), "
    "cpu+kv_store (and the mesh's kv_store, published to kv_indexer). See engine_simulator/README.md.")]


def engine_scheduler(threshold: int | None, adaptive: bool, max_model_len: int,
                     reserve_full_isl: bool | None = None) -> dict[str, object]:
    """The engines' scheduler settings (``--long-prefill-token-threshold[-adaptive]``,
    ``--[no-]scheduler-reserve-full-isl``), the threshold checked as vLLM 0.32 checks it against the engines'
    ``max_model_len``; the dict is what ``compare``'s JSON records as ``engine_scheduler`` (the simulated
    engines' effective values: threshold 0 = off, their default).

    Raises:
        typer.BadParameter: a threshold above ``max_model_len`` (vLLM refuses to start with one).
    """
    from engine_simulator.scheduler import check_long_prefill_token_threshold

    if threshold is not None:
        try:
            check_long_prefill_token_threshold(threshold, max_model_len)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--long-prefill-token-threshold") from None
    if adaptive and not threshold:
        console.print("--long-prefill-token-threshold-adaptive has no effect without a non-zero "
                      "--long-prefill-token-threshold (as in vLLM)", soft_wrap=True)
    return {"long_prefill_token_threshold": SIMULATOR_DEFAULTS.long_prefill_token_threshold if threshold is None
            else threshold, "long_prefill_token_threshold_adaptive": adaptive,
            "scheduler_reserve_full_isl": SIMULATOR_DEFAULTS.scheduler_reserve_full_isl if reserve_full_isl is None
            else reserve_full_isl}


def engine_scheduler_label(settings: dict[str, object]) -> str:
    """``", long_prefill_token_threshold 512 (adaptive)"`` for a table title (and ``", no scheduler_reserve_full_isl"``
    when that is off); empty for the simulator's defaults (vLLM 0.32's: threshold off, full-ISL reservation on)."""
    out = ""
    if settings.get("long_prefill_token_threshold"):
        adaptive = " (adaptive)" if settings.get("long_prefill_token_threshold_adaptive") else ""
        out = f", long_prefill_token_threshold {settings['long_prefill_token_threshold']}{adaptive}"
    if settings.get("scheduler_reserve_full_isl", True) is False:
        out += ", no scheduler_reserve_full_isl"
    return out


def _offload_mode(value: str) -> str:
    if value not in OFFLOAD_MODES:
        raise typer.BadParameter(f"{value!r}: expected one of {', '.join(OFFLOAD_MODES)}", param_hint="--offload")
    return value


@dataclass(frozen=True)
class Column:
    """One column of ``compare``: a fresh mesh whose engines run ``offload``, replayed through kvmesh's
    router with epp config ``policy`` or through the peer router ``peer`` (exactly one of them is set)."""

    name: str
    """The label in the table and the JSON's ``policies`` key: ``<policy or peer>`` with offload off,
    ``<policy or peer>+<offload>`` otherwise (e.g. ``precise-prefix+cpu``)."""
    policy: str | None
    peer: str | None
    offload: str


def split_offload(value: str, default: str, *, exists: bool = False) -> tuple[str, str]:
    """``(base, offload)`` of a ``--policies``/``--peers`` entry: ``NAME+MODE`` for MODE in
    :data:`OFFLOAD_MODES` (``precise-prefix+cpu``, ``tier-cost+cpu+kv_store``, ``round-robin+off``);
    a plain ``NAME`` (or one that ``exists`` as given, e.g. a YAML path with ``+`` in it) gets ``default``.

    Raises:
        ValueError: a ``+`` suffix that is no offload mode (the message lists them).
    """
    if "+" not in value or exists:
        return value, default
    for mode in sorted(OFFLOAD_MODES, key=len, reverse=True):  # cpu+kv_store before cpu
        if value.endswith(f"+{mode}") and len(value) > len(mode) + 1:
            return value[: -len(mode) - 1], mode
    raise ValueError(f"{value!r}: the part after '+' must be an offload mode ({', '.join(OFFLOAD_MODES)})")


def column_label(base: str, offload: str) -> str:
    """A column's name: ``base`` with offload off, ``base+offload`` otherwise."""
    return base if offload == "off" else f"{base}+{offload}"


def compare_columns(policies: str, peers: str, default_offload: str) -> list[Column]:
    """``compare``'s columns from ``--policies`` and ``--peers`` (each entry ``NAME[+OFFLOAD]``, plain names
    keep ``--offload``), policies resolved (:func:`resolve_policy`) and peers checked as installed.

    Raises:
        typer.BadParameter: no column, an unknown policy, peer or offload suffix, or two columns with the
            same label.
    """
    columns: list[Column] = []
    for hint, text in (("--policies", policies), ("--peers", peers)):
        entries = [p.strip() for p in text.split(",")]
        if not any(entries):
            continue  # --peers '' : no peers (an empty --policies: "no policy given" below)
        for entry in entries:
            if not entry:
                raise typer.BadParameter(f"an empty entry in {text!r}", param_hint=hint)
            exists = hint == "--policies" and "/" in entry and Path(entry).expanduser().is_file()
            try:
                base, offload = split_offload(entry, default_offload, exists=exists)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=hint) from None
            if hint == "--policies":
                try:
                    policy = resolve_policy(base, param_hint=hint)
                except typer.BadParameter:
                    if "+" not in base:
                        raise
                    raise typer.BadParameter(  # e.g. round-robin+cpu+off: two offload parts
                        f"{entry!r}: give one offload mode after the policy's name ({', '.join(OFFLOAD_MODES)}); "
                        f"{base!r} is no scheduling config", param_hint=hint) from None
                columns.append(Column(column_label(base, offload), policy, None, offload))
            else:
                missing = peer_missing_reason(base)
                if missing:
                    raise typer.BadParameter(missing, param_hint=hint)
                columns.append(Column(column_label(base, offload), None, base, offload))
    if not columns:
        raise typer.BadParameter("no policy given", param_hint="--policies")
    seen: set[str] = set()
    for col in columns:
        if col.name in seen:
            raise typer.BadParameter(f"column {col.name!r} given twice", param_hint="--policies")
        seen.add(col.name)
    return columns

app = typer.Typer(
    help="kvmesh: run a local mesh with simulated engines, replay workloads, compare routing policies.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's help layout: every option name whole at 80 columns (rich's table truncates)
)
console = Console()

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a command (:func:`~kvmesh_cli.mesh.exit_on_signals`); Ctrl-C is SIGINT."""
EXIT_INTERRUPTED = 130
"""Exit status of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it); every command."""

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _ignore_signals() -> None:
    """On the way out of an interrupted command: a further Ctrl-C (or SIGTERM/SIGHUP) changes nothing (no
    traceback, no click "Aborted!" with exit 1 in place of 130). Main thread only (elsewhere a no-op)."""
    for s in INTERRUPT_SIGNALS:
        with contextlib.suppress(ValueError):
            signal.signal(s, signal.SIG_IGN)


def exits_130_when_interrupted(command: Callable[_P, _R]) -> Callable[_P, _R]:
    """A ``kvmesh`` command whose KeyboardInterrupt, wherever it lands (loading a workload, making its run folder,
    printing the results: the stretches outside the command's own guarded blocks), ends in one
    ``interrupted (...)`` line on stderr and exit 130, never click's "Aborted!" and exit 1. What the command
    started is stopped by its own ``with`` blocks on the way out."""
    name = command.__name__.removesuffix("_cmd")

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt as exc:
            _ignore_signals()
            err_console.print(f"interrupted ({_how_interrupted(exc)}): kvmesh {name} stopped", markup=False,
                              highlight=False, soft_wrap=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return run


def _run_dir(run_dir: Path | None, command: str) -> Path:
    """``--run-dir`` made and checked writable, else a fresh ``.run/<command>-<time>-<pid>`` of this run alone
    (:func:`~kvmesh_cli.checks.new_run_dir`); absolute either way. With the default, the etcd data earlier
    runs under ``.run/`` left when they were killed is deleted (:func:`~kvmesh_cli.rundir.sweep_stale_etcd_data`;
    never a running mesh's), and a line says so.

    Raises:
        typer.BadParameter: the folder cannot be made or written (a file in its place, a read-only filesystem).
    """
    if run_dir is not None:
        return check_dir_option(run_dir, "--run-dir", create=True)
    path = new_run_dir(command).resolve()
    swept = sweep_stale_etcd_data(path.parent)
    if swept:
        console.print(f"deleted the etcd data that {len(swept)} killed earlier run(s) left in {path.parent} "
                      f"({', '.join(d.parent.name for d in swept)})", soft_wrap=True, markup=False, highlight=False)
    return path


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvmesh")
    except PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"kvmesh {_package_version()}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print kvmesh's version and exit.", is_eager=True,
                                          callback=_version_callback)] = False,
) -> None:
    """kvmesh: run a local mesh with simulated engines, replay workloads, compare routing policies."""


def _check_plot_format(path: Path) -> Path:
    """``--plot``'s file type, checked against matplotlib's own list (when it is installed) before the run.

    Raises:
        typer.BadParameter: a suffix matplotlib cannot write (``.txt``); no suffix writes a PNG.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return path
    kinds = Figure().canvas.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in kinds:
        raise typer.BadParameter(f"matplotlib cannot write {path.suffix!r} files; use one of "
                                 f"{', '.join('.' + k for k in sorted(kinds))}", param_hint="--plot")
    return path


def _write_output(path: Path, write: Callable[[Path], object], what: str, fallback: Path | None = None) -> bool:
    """Write one result file at the end of a run; a failure (the disk filled, the folder vanished) says where it
    could not be written and, for ``fallback``, writes it there instead: results are never lost to a traceback.
    Returns whether ``path`` was written."""
    try:
        write(path)
    except OSError as exc:
        line = f"could not write {what} to {path}: {os_error_text(exc)}"
        if fallback is not None:
            try:
                write(fallback)
                line += f"; wrote it to {fallback} instead"
            except OSError:
                pass
        err_console.print(f"error: {line}", soft_wrap=True, markup=False, highlight=False)
        return False
    return True


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def build_workload(
    trace: Path | None, workload: str, requests: int, seed: int, max_input_tokens: int | None, max_output_tokens: int,
    agentic: AgenticParams | None = None,
) -> Workload:
    """:func:`kvmesh_cli.workloads.load_workload`, its errors as ``typer.BadParameter`` naming the option."""
    try:
        return load_workload(trace, workload, requests, seed, max_input_tokens, max_output_tokens, agentic)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc), param_hint=exc.option) from None


def _workload_line(wl: Workload, label: str, asked: str | None = None) -> str:
    """One line describing ``wl``; when ``asked`` is ``agentic`` and the traces were missing (so the
    sessions were generated), a second line saying which path was looked for."""
    st = workload_stats(wl)
    line = (f"workload {label}: {st['requests']} requests over {st.get('span_s', 0):.1f} model s, "
            f"prompt mean {st.get('input_tokens_mean', 0):.0f} / max {st.get('input_tokens_max', 0)} tokens, "
            f"output mean {st.get('output_tokens_mean', 0):.0f} tokens")
    if asked == "agentic" and wl.name == "agentic-synthetic":
        line += (f"\n  (agentic-synthetic: no kv-cache-tester traces at {DEFAULT_AGENTIC_ARCHIVE}, the checkout's "
                 "sibling shared/data/traces/; generated sessions of the same shape instead. "
                 "A real trace: --trace FILE, or make run TRACE=FILE)")
    return line


def _run_replay(
    wl: Workload, router_url: str, engine_urls: list[str], time_scale: float, concurrency: int,
    model: str | None, label: str, *, sessions: int | None = None, prompt_format: str = "tokens",
    sampler: EngineSampler | None = None, show_progress: bool = True, router_metrics_url: str | None = None,
    flow_control_metrics_url: str | None = None, api_key: str | None = None,
) -> ReplayOutcome:
    with Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("errors {task.fields[errors]}"),
        TimeElapsedColumn(), console=console, transient=False, disable=not show_progress,
    ) as progress:
        task = progress.add_task(label, total=len(wl.requests), errors=0)
        errors = done = 0

        def on_done(res: RequestResult) -> None:
            nonlocal errors, done
            errors += 0 if res.ok else 1
            done += 1
            progress.update(task, advance=1, errors=errors)

        try:
            return run_interruptible(replay(
                wl, router_url=router_url, engine_urls=engine_urls, time_scale=time_scale,
                concurrency_limit=concurrency, model=model, on_done=on_done, max_sessions=sessions,
                prompt_format=prompt_format, sampler=sampler, router_metrics_url=router_metrics_url,
                flow_control_metrics_url=flow_control_metrics_url, api_key=api_key,
            ))
        except KeyboardInterrupt as exc:  # Ctrl-C: how far it got, for the interrupted line
            exc.add_note(f"{done} of {len(wl.requests)} requests finished, {errors} failed")
            raise
        except httpx.HTTPStatusError as exc:  # discovering the model: a router in API-key mode, without a key
            progress.stop()
            status = exc.response.status_code
            fail(api_key_refusal(router_url, status, api_key) if status in (401, 403)
                 else f"router {router_url} answered GET /v1/models with HTTP {status}")
        except httpx.HTTPError as exc:  # discovering the model; requests themselves never raise
            progress.stop()
            fail(f"router {router_url}: {type(exc).__name__}: {exc}")
        except RuntimeError as exc:  # the router lists no model
            progress.stop()
            fail(str(exc))


def _summary(
    outcome: ReplayOutcome, time_scale: float, *, wl: Workload | None = None, slo_ttft_s: float | None = None,
    engine_urls: list[str] | None = None, block_size: int | None = None, offload: str | None = None,
) -> dict[str, object]:
    """Summary of one replay; with ``wl`` the oracle hit rate over the requests in the order they were sent."""
    oracle: float | None = None
    if wl is not None and block_size:
        by_index = {r.index: r for r in wl.requests}
        sent = sorted((r for r in outcome.results if r.sent_at is not None), key=lambda r: r.sent_at or 0.0)
        hits, queries = oracle_hits((by_index[r.index] for r in sent), block_size)
        oracle = hits / queries if queries else None
    ttfts = [r.ttft_s * time_scale for r in outcome.results if r.ok and r.ttft_s is not None]
    breakdown = ttft_breakdown(outcome.histograms_before, outcome.histograms_after, outcome.router_before,
                               outcome.router_after, time_scale=time_scale,
                               ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None, load=outcome.load)
    split = load_split(outcome.counters_before, outcome.counters_after, engine_urls) if engine_urls or \
        outcome.counters_after else None
    return summarize(
        outcome.results, wall_duration_s=outcome.wall_duration_s, time_scale=time_scale,
        prefix_hit_rate=hit_rate(outcome.counters_before, outcome.counters_after), slo_ttft_s=slo_ttft_s,
        oracle_hit_rate=oracle, split=split, offload=offload,
        offload_hit_rate=offload_hit_rate(outcome.counters_before, outcome.counters_after),
        first_calls=(frozenset(r.index for r in wl.requests if r.after is None)
                     if wl is not None and any(r.after is not None for r in wl.requests) else None),
        breakdown=breakdown,
    )


def _engine_line(outcome: ReplayOutcome) -> None:
    parts = [f"{url.rsplit(':', 1)[-1]}: {n} req, {fmt(rate, 'pct')} hits"
             for url, (n, rate) in sorted(per_engine(outcome.counters_before, outcome.counters_after).items())]
    if parts:
        console.print("engines (port): " + "; ".join(parts), soft_wrap=True)
    if outcome.loop_lag_s:
        lags = outcome.loop_lag_s
        console.print(f"replay client loop lag (wall ms): mean {1e3 * sum(lags) / len(lags):.1f}, "
                      f"p99 {1e3 * (percentile(lags, 99) or 0.0):.1f}, max {1e3 * max(lags):.1f}", soft_wrap=True)


def _first_errors(outcome: ReplayOutcome, n: int = 3) -> None:
    bad = [r for r in outcome.results if not r.ok]
    for r in bad[:n]:
        console.print(f"[red]request {r.index} failed:[/red] {r.error}", soft_wrap=True)


# --- up ---------------------------------------------------------------------------------------


def mesh_table(mesh: Mesh) -> Table:
    """Where each member listens; addresses never wrap (only the log path folds, on a narrow terminal)."""
    table = Table(title=f"kvmesh: {_count(mesh.spec.engines, 'engine')}, policy {mesh.spec.policy}")
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


def _count(n: int, noun: str) -> str:
    """``"1 engine"``, ``"4 engines"``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


KEY_PLACEHOLDER = "KEY"
"""What the printed commands carry for a key the router requires when the CLI knows none."""


def _key_for_hints(api_key: str | None, key_required: bool) -> str | None:
    return api_key or (KEY_PLACEHOLDER if key_required else None)


def ready_lines(mesh: Mesh, api_key: str | None = None, key_required: bool = False) -> list[str]:
    """The ``kvmesh ready`` line (router URL is its 4th word), how to replay against this mesh and how to see its
    admission state. ``api_key``: a client key the router accepts (:meth:`Mesh.router_api_key`), put in the replay
    command as ``--api-key``; ``key_required`` without one (the router refused the keyless readiness probe):
    ``--api-key KEY``, a placeholder for one of its tenants' keys. Pasted, the command is not refused (401)."""
    grpc_of = {m.name: m.grpc for m in mesh.members if m.grpc}
    others = " ".join(f"{name} {grpc_of[name]}" for name in ("flow_control", "kv_indexer", "kv_store") if name in grpc_of)
    key = _key_for_hints(api_key, key_required)
    return [
        (f"kvmesh ready: router {mesh.router_url} model {mesh.spec.model} epp {mesh.epp_address} "
         f"etcd {mesh.etcd_address} {others} (Ctrl-C to stop)"),
        (f"replay against it: kvmesh replay --router {mesh.router_url} --epp {mesh.epp_address}"
         + (f" --api-key {shlex.quote(key)}" if key else "")
         + (f" --time-scale {mesh.spec.time_scale:g}" if mesh.spec.time_scale not in (None, 1.0) else "")),
        f"admission state: kvmesh flows --etcd {mesh.etcd_address}",
    ]


def request_hint(mesh: Mesh, api_key: str | None = None, key_required: bool = False) -> str:
    """A ``curl`` command sending one completion to this mesh's router, with ``Authorization: Bearer <api_key>``
    when a key is in use (``KEY`` when the router requires one the CLI does not know; see :func:`ready_lines`)."""
    key = _key_for_hints(api_key, key_required)
    body = json.dumps({"model": mesh.spec.model, "prompt": "Hello", "max_tokens": 16})
    auth = f" -H {shlex.quote(f'authorization: Bearer {key}')}" if key else ""
    line = (f"send a request: curl -s {mesh.router_url}/v1/completions -H 'content-type: application/json'{auth} "
            f"-d {shlex.quote(body)}")
    if key == KEY_PLACEHOLDER:
        line += "  (the router requires an API key: put one of its tenants' keys for KEY)"
    return line


@app.command()
@exits_130_when_interrupted
def up(
    engines: EnginesOpt = DEFAULT_ENGINES,
    policy: Annotated[str, typer.Option("--policy", help="epp scheduling config: round-robin, load-only, "
                                        "precise-prefix, llm-d-blend, prefill-cost, dynamo-cost, tier-cost (services/epp/configs/) "
                                        "or a YAML path.")] = "tier-cost",
    etcd: EtcdOpt = None,
    time_scale: TimeScaleOpt = 1.0,
    run_dir: RunDirOpt = None,
    num_gpu_blocks: BlocksOpt = 2048,
    block_size_tokens: Annotated[int | None, typer.Option(
        "--block-size-tokens", min=1, max=MAX_BLOCK_SIZE_TOKENS, help=f"Tokens per KV block (default {SIMULATOR_DEFAULTS.block_size_tokens}; "
        "32 with --engine vllm, "
        "whose CPU attention needs a multiple of 32).")] = None,
    max_num_seqs: MaxSeqsOpt = None,
    model: Annotated[str | None, typer.Option("--model", callback=check_model_name, help=f"Served model name of the "
                                              f"engines (default {DEFAULT_MODEL}; tiny with --engine vllm).")] = None,
    router_port: Annotated[int | None, typer.Option("--router-port", min=1, max=65535,
                                                    help="Router HTTP port, 1-65535 (default: free).")] = None,
    router_grpc_port: Annotated[int | None, typer.Option("--router-grpc-port", min=1, max=65535,
                                                         help="Router gRPC port, 1-65535 (default: free).")] = None,
    engine: Annotated[str, typer.Option(
        "--engine", help="simulator (default) or vllm: real vLLM CPU servers on the tiny model, each with a "
        "registration sidecar (needs `make vllm-env model`; ~30-60 s to start, ~3 GB RAM and 2 cores each). "
        "--time-scale and --num-gpu-blocks apply to the simulator only.")] = "simulator",
    offload: OffloadOpt = "off",
    long_prefill_token_threshold: LongPrefillOpt = None,
    long_prefill_token_threshold_adaptive: LongPrefillAdaptiveOpt = False,
    scheduler_reserve_full_isl: ReserveFullIslOpt = None,
    api_key: UpApiKeyOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Start etcd, the five services and N engines (simulated, or real vLLM) in the foreground; Ctrl-C stops all.

    Exit status: 130 on Ctrl-C (SIGINT) at any stage, and on any stop signal before the mesh is ready, once what
    had started is stopped; 0 when SIGTERM or SIGHUP stops a ready mesh (a service manager's normal stop); 1 when
    the mesh does not start; 2 for bad options (two of its ports the same among them, a --router-port or
    --router-grpc-port another process listens on, a --policy file epp would refuse, an --etcd that is not
    host:port), before anything starts.
    """
    _setup_logging(verbose)
    flag_of = {"router_http_port": "--router-port", "router_grpc_port": "--router-grpc-port", "etcd": "--etcd"}
    clash = port_clash(configured_ports(MeshSpec(run_dir=Path(), etcd=etcd, router_http_port=router_port,
                                                 router_grpc_port=router_grpc_port)), flag_of.__getitem__)
    if clash:
        free = "" if "--etcd" in clash else " (leave one out and a free one is chosen)"
        raise typer.BadParameter(f"both are {clash[2]}; give each its own port{free}", param_hint=[clash[0], clash[1]])
    taken = taken_port({"router_http_port": router_port or 0, "router_grpc_port": router_grpc_port or 0})
    if taken:
        raise typer.BadParameter(f"{taken[1]}; another process listens there: choose another port, or leave the "
                                 "option out for a free one", param_hint=flag_of[taken[0]])
    extra: dict[str, object] = {}
    if engine == "vllm":
        from kvmesh_cli.vllm_engine import VLLM_BLOCK_SIZE_TOKENS, VLLM_MODEL, vllm_missing_reason

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
    engine_max_model_len = 2048 if engine == "vllm" else min(
        SIMULATOR_DEFAULTS.max_model_len,
        (num_gpu_blocks - 1) * (block_size_tokens or SIMULATOR_DEFAULTS.block_size_tokens))
    engine_scheduler(long_prefill_token_threshold, long_prefill_token_threshold_adaptive, engine_max_model_len)
    policy = resolve_policy(policy)
    offload = _offload_mode(offload)
    spec = MeshSpec(
        run_dir=_run_dir(run_dir, "up"), engines=engines, policy=policy,
        time_scale=time_scale, model=model or DEFAULT_MODEL, num_gpu_blocks=num_gpu_blocks,
        block_size_tokens=block_size_tokens, max_num_seqs=max_num_seqs, etcd=etcd,
        router_http_port=router_port, router_grpc_port=router_grpc_port, offload=offload,
        long_prefill_token_threshold=long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
        scheduler_reserve_full_isl=scheduler_reserve_full_isl, router_api_key=api_key,
        **extra,  # type: ignore[arg-type]
    )
    console.print(f"starting mesh in {spec.run_dir} ...", soft_wrap=True)

    def progress(line: str) -> None:
        console.print(f"  {line}", soft_wrap=True, markup=False, highlight=False)

    ready = False
    stopped_by: KeyboardInterrupt | None = None  # the signal that stopped the ready mesh
    try:
        with exit_on_signals(INTERRUPT_SIGNALS), mesh_errors(), Mesh(spec, progress=progress) as mesh:
            ready = True
            try:
                _serve(mesh)
            except KeyboardInterrupt as exc:
                stopped_by = exc
                console.print("stopping mesh ...")
            # leaving the block stops the mesh (in parallel); a second signal cuts that short (SIGKILL)
    except KeyboardInterrupt as exc:  # during start-up (what had started is stopped), or a second one while stopping
        _ignore_signals()
        what = ("while the mesh stopped: what was left was killed" if ready
                else "during start-up: what had started is stopped")
        err_console.print(f"interrupted ({_how_interrupted(exc)}) {what}; logs in {spec.run_dir}", markup=False,
                          highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    if stopped_by is not None:
        _ignore_signals()
    console.print("kvmesh stopped")
    if stopped_by is not None and _signal_of(stopped_by) == signal.SIGINT:
        raise typer.Exit(EXIT_INTERRUPTED)


def _signal_of(exc: KeyboardInterrupt) -> int:
    """The signal an interrupt came from: N of :func:`~kvmesh_cli.mesh.exit_on_signals`' ``"signal N"``, else
    SIGINT (Python's own KeyboardInterrupt is Ctrl-C)."""
    signum = str(exc).removeprefix("signal ")
    return int(signum) if signum.isdigit() else int(signal.SIGINT)


def _serve(mesh: Mesh) -> None:
    """``kvmesh up`` once the mesh is ready: print where everything listens and how to use it, then watch the
    members until interrupted, saying how each one that dies ended (exit code or signal) and where its log is."""
    api_key = mesh.router_api_key()
    print_table(console, mesh_table(mesh))
    for line in [*ready_lines(mesh, api_key, mesh.router_requires_key),
                 request_hint(mesh, api_key, mesh.router_requires_key)]:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    dead: set[str] = set()
    while True:
        time.sleep(0.5)
        for line in exit_lines(mesh.members, dead):
            console.print(Text(line, style="red"), soft_wrap=True, highlight=False)


def exit_lines(members: list[Member], seen: set[str]) -> list[str]:
    """One line per member that has died since the last call (``seen``: the names said already, updated): how it
    ended and where its log is, ``engine-1 exited: killed by SIGKILL; log /run/engine-1.log``."""
    lines = []
    for m in members:
        if m.name not in seen and not m.process.alive():
            seen.add(m.name)
            lines.append(f"{m.name} exited: {m.process.exit_note()}")
    return lines


# --- replay -----------------------------------------------------------------------------------


@app.command("replay")
@exits_130_when_interrupted
def replay_cmd(
    router: Annotated[str | None, typer.Option("--router", help="Router base URL, e.g. http://127.0.0.1:8000; "
                                               "default: start a mesh for this replay.")] = None,
    epp: Annotated[str | None, typer.Option("--epp", help="epp gRPC host:port, to find the engines to scrape "
                                            "(with --router); when it does not answer, --etcd is asked for "
                                            "another epp, then for the engines.")] = None,
    etcd: EtcdOpt = None,
    trace: TraceOpt = None,
    workload: WorkloadOpt = "multi-turn",
    requests: RequestsOpt = 100,
    seed: SeedOpt = 0,
    time_scale: TimeScaleOpt = 1.0,
    concurrency_limit: ConcurrencyOpt = DEFAULT_CONCURRENCY,
    max_input_tokens: MaxInOpt = None,
    max_output_tokens: MaxOutOpt = DEFAULT_MAX_OUTPUT_TOKENS,
    rate_scale: RateScaleOpt = 1.0,
    sessions: SessionsOpt = None,
    prompt_format: Annotated[str, typer.Option("--prompt-format", help="tokens (ids, <s> first) or text (the same "
                                               "ids as text, for routers that refuse ids).")] = "tokens",
    json_out: JsonOutOpt = None,
    model: Annotated[str | None, typer.Option("--model", callback=check_model_name,
                                              help="Model name; default: the router's first.")] = None,
    engines: EnginesOpt = DEFAULT_ENGINES,
    policy: Annotated[str, typer.Option("--policy", help="Policy of the mesh started without --router.")] =
        "tier-cost",
    num_gpu_blocks: AutoBlocksOpt = None,
    run_dir: RunDirOpt = None,
    long_prefill_token_threshold: LongPrefillOpt = None,
    long_prefill_token_threshold_adaptive: LongPrefillAdaptiveOpt = False,
    scheduler_reserve_full_isl: ReserveFullIslOpt = None,
    api_key: ApiKeyOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Send a workload through the router and report TTFT, latency, throughput and prefix-cache hits.

    With --router, the engines whose /metrics are scraped for the hit rate come from --epp
    (ListEndpoints) or --etcd (an epp registered there, else the engines registered there, when --epp
    does not answer); an --epp that does not answer without --etcd, or an --etcd that does not answer,
    is an error before any request is sent. --time-scale must then match the engines' own. Without
    --router, a mesh with --engines/--policy/--num-gpu-blocks (and the engines' scheduler options, as
    ``up`` and ``compare`` take them) is started for the replay and stopped after; with --router those
    scheduler options are refused (the engines are already running).

    Exit status: 0 when every request succeeded; 1 when any failed (the table and --json-out are still
    written, the first errors printed), or on a failure to start or reach the router; 130 on Ctrl-C (what was
    and was not written is said).
    """
    _setup_logging(verbose)
    if json_out is not None:
        json_out = check_output_file(json_out, "--json-out")
    if run_dir is not None:
        run_dir = check_dir_option(run_dir, "--run-dir")
    for value, hint in ((epp, "--epp"), (etcd, "--etcd")):
        if value:
            try:
                split_host_port(value)
            except ValueError as exc:
                raise typer.BadParameter(str(exc), param_hint=hint) from None
    num_gpu_blocks = num_gpu_blocks or default_num_gpu_blocks(trace, workload)
    scheduler_settings: dict[str, object] | None = None
    if router is not None:
        given = [flag for flag, value in (
            ("--long-prefill-token-threshold", long_prefill_token_threshold is not None),
            ("--long-prefill-token-threshold-adaptive", long_prefill_token_threshold_adaptive),
            ("--[no-]scheduler-reserve-full-isl", scheduler_reserve_full_isl is not None)) if value]
        if given:
            raise typer.BadParameter("sets the engines of the mesh replay starts without --router; with --router "
                                     "the engines are already running (set it where they are started)",
                                     param_hint=given[0])
        router = check_router_url(router)
    else:
        policy = resolve_policy(policy)
        scheduler_settings = engine_scheduler(
            long_prefill_token_threshold, long_prefill_token_threshold_adaptive,
            min(SIMULATOR_DEFAULTS.max_model_len, (num_gpu_blocks - 1) * SIMULATOR_DEFAULTS.block_size_tokens),
            scheduler_reserve_full_isl)
    if prompt_format not in PROMPT_FORMATS:
        raise typer.BadParameter(f"{prompt_format!r}: expected one of {', '.join(PROMPT_FORMATS)}",
                                 param_hint="--prompt-format")
    wl = scale_load(build_workload(trace, workload, requests, seed, max_input_tokens, max_output_tokens), rate_scale)
    label = trace.name if trace else workload
    console.print(_workload_line(wl, label, None if trace else workload), soft_wrap=True, markup=False)
    if router is not None:
        # Ctrl-C wherever it lands (finding the engines, probing the router, the requests): the one line, 130
        with _replay_interrupted(json_out, None), exit_on_signals(then_ignore=True):
            try:
                engine_urls = find_engines(epp, etcd,
                                           say=lambda line: console.print(line, soft_wrap=True, markup=False))
            except DiscoveryError as exc:
                fail(str(exc))
            probe_router(router, api_key=api_key)
            if not epp and not etcd:
                console.print("no --epp/--etcd: the engine prefix-cache hit rate is not measured", soft_wrap=True)
            elif not engine_urls:
                console.print(f"no engines listed by {'epp ' + epp if epp else 'etcd ' + str(etcd)}: the engine "
                              "prefix-cache hit rate is not measured", soft_wrap=True, markup=False)
            outcome = _run_replay(wl, router, engine_urls, time_scale, concurrency_limit, model, label,
                                  sessions=sessions, prompt_format=prompt_format, api_key=api_key)
        column = router
    else:
        mesh_dir = _run_dir(run_dir, "replay")
        spec = MeshSpec(run_dir=mesh_dir, engines=engines, policy=policy,
                        time_scale=time_scale, num_gpu_blocks=num_gpu_blocks, etcd=etcd,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
                        scheduler_reserve_full_isl=scheduler_reserve_full_isl, router_api_key=api_key)
        if scheduler_settings is not None and (extra := engine_scheduler_label(scheduler_settings)):
            console.print(f"engines: {extra.removeprefix(', ')}", soft_wrap=True, markup=False)
        with (_replay_interrupted(json_out, mesh_dir), exit_on_signals(then_ignore=True), mesh_errors(),
              Mesh(spec) as mesh):
            outcome = _run_replay(wl, mesh.router_url, mesh.engine_urls, time_scale, concurrency_limit, model, label,
                                  sessions=sessions, prompt_format=prompt_format, api_key=mesh.router_api_key())
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
        if scheduler_settings is not None:  # the mesh replay started (compare records the same)
            doc["engine_scheduler"] = scheduler_settings
        text = json.dumps(doc, indent=2) + "\n"
        if _write_output(json_out, lambda p: p.write_text(text), "the results"):
            console.print(f"wrote {json_out}")
        else:
            console.print(text, markup=False, highlight=False, soft_wrap=True)  # never lost: on stdout instead
    failed = sum(1 for r in outcome.results if not r.ok)
    if failed:
        err_console.print(f"error: {failed} of {len(outcome.results)} requests failed", soft_wrap=True,
                          markup=False, highlight=False)
        raise typer.Exit(1)


def _how_interrupted(exc: KeyboardInterrupt) -> str:
    """``"signal N"`` for a :func:`~kvmesh_cli.mesh.exit_on_signals` / ``run_interruptible`` interrupt
    (its message is ``"signal N"``), else ``"Ctrl-C"`` (Python's own ``KeyboardInterrupt``)."""
    signum = str(exc).removeprefix("signal ")
    return f"signal {signum}" if signum.isdigit() else "Ctrl-C"


@contextlib.contextmanager
def _replay_interrupted(json_out: Path | None, run_dir: Path | None) -> Iterator[None]:
    """Ctrl-C (or SIGTERM/SIGHUP) during ``replay``: the mesh (if it started one) is stopped by its ``with``;
    say so and what was not written, exit 130 (128 + SIGINT), as ``compare`` does. Further
    signals are ignored by then (``exit_on_signals(then_ignore=True)``)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        how = _how_interrupted(exc)
        progress = next(iter(getattr(exc, "__notes__", [])), "")
        err_console.print(
            f"interrupted ({how}): the replay stopped before its end"
            + (f" ({progress})" if progress else "")
            + (", its mesh stopped" if run_dir is not None else "") + "; no table printed"
            + (f", nothing written to {json_out}" if json_out is not None else "")
            + (f"; the mesh's logs are in {run_dir}" if run_dir is not None else ""),
            soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(130) from None


# --- compare ----------------------------------------------------------------------------------


@dataclass
class RunSettings:
    """What every run of a ``compare`` shares (one mesh per policy, peer or sweep point)."""

    engines: int
    num_gpu_blocks: int
    block_size_tokens: int | None
    max_num_seqs: int | None
    time_scale: float
    concurrency: int
    sessions: int | None
    slo_ttft_s: float
    etcd: str | None
    parallel: bool = False
    """Run a rate's columns at once, each on its own mesh (``compare --parallel``)."""
    long_prefill_token_threshold: int | None = None
    """Every engine's ``--long-prefill-token-threshold`` (None: the engine's default, off)."""
    long_prefill_token_threshold_adaptive: bool = False
    """Every engine's ``--long-prefill-token-threshold-adaptive``."""
    scheduler_reserve_full_isl: bool | None = None
    """Every engine's ``--[no-]scheduler-reserve-full-isl`` (None: the engine's default)."""
    api_key: str | None = None
    """Client API key for kvmesh's router (``compare --api-key``): its readiness check and the replay send it;
    None: the first key of ``KVMESH_ROUTER_TENANTS``, if any (:meth:`Mesh.router_api_key`). Peers get none."""


def _run_one(wl: Workload, rs: RunSettings, run_dir: Path, name: str, policy: str | None, peer: str | None,
             label: str, offload: str = "off", timeline: Path | None = None) -> dict[str, object]:
    """One fresh mesh (engines with ``offload``); the replay through its router (``policy``) or through a
    peer router over its engines. ``timeline``: sample the engines' load during it, print its summary
    line and write the samples there (JSON lines)."""
    spec = MeshSpec(
        run_dir=run_dir, engines=rs.engines, policy=policy or "round-robin", time_scale=rs.time_scale,
        num_gpu_blocks=rs.num_gpu_blocks, block_size_tokens=rs.block_size_tokens, max_num_seqs=rs.max_num_seqs,
        etcd=rs.etcd, offload=offload, long_prefill_token_threshold=rs.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=rs.long_prefill_token_threshold_adaptive,
        scheduler_reserve_full_isl=rs.scheduler_reserve_full_isl, router_api_key=rs.api_key,
    )
    t0 = time.monotonic()
    sampler: EngineSampler | None = None
    with Mesh(spec) as mesh:
        metrics_urls = {m.name: m.metrics for m in mesh.members if m.name in ("router", "flow_control")}
        if timeline is not None:
            router_metrics = next((m.metrics for m in mesh.members if m.name == "router"), None) if peer is None else None
            sampler = EngineSampler(mesh.engine_urls, TIMELINE_INTERVAL_S, rs.time_scale,
                                    router_metrics_url=router_metrics)
        if peer is None:
            console.print(f"[bold]{name}[/bold]: mesh up in {time.monotonic() - t0:.1f}s", soft_wrap=True)
            outcome = _run_replay(wl, mesh.router_url, mesh.engine_urls, rs.time_scale, rs.concurrency, None, label,
                                  sessions=rs.sessions, sampler=sampler, show_progress=not rs.parallel,
                                  router_metrics_url=metrics_urls.get("router"),
                                  flow_control_metrics_url=metrics_urls.get("flow_control"),
                                  api_key=mesh.router_api_key())
        else:
            from engine_simulator.tokenizer import ensure_tokenizer
            from kvmesh_cli.peers import PeerRouter

            try:
                router = PeerRouter(peer, mesh.engine_urls, run_dir, ensure_tokenizer(None))
                router.__enter__()
            except RuntimeError as exc:
                fail(str(exc))
            try:
                console.print(f"[bold]{name}[/bold]: engines and {peer} up in {time.monotonic() - t0:.1f}s",
                              soft_wrap=True)
                outcome = _run_replay(wl, router.url, mesh.engine_urls, rs.time_scale, rs.concurrency, mesh.spec.model,
                                      label, sessions=rs.sessions, prompt_format=router.spec.prompt_format,
                                      sampler=sampler, show_progress=not rs.parallel)
            finally:
                router.__exit__()
        engine_urls = list(mesh.engine_urls)
    if rs.parallel:
        console.print(f"[bold]{name}[/bold]: {len(outcome.results)} requests done", soft_wrap=True)
    _first_errors(outcome)
    _engine_line(outcome)
    summary = _summary(outcome, rs.time_scale, wl=wl, slo_ttft_s=rs.slo_ttft_s, engine_urls=engine_urls,
                       block_size=rs.block_size_tokens or SIMULATOR_DEFAULTS.block_size_tokens, offload=offload)
    if sampler is not None and timeline is not None:
        points = sampler.points
        with contextlib.suppress(OSError):  # checked at start (compare --timeline); a failure is reported below
            timeline.parent.mkdir(parents=True, exist_ok=True)
        _write_output(timeline, lambda p: write_timeline(points, p), "the timeline", fallback=run_dir / timeline.name)
        reduced = timeline_summary(sampler.points)
        console.print(timeline_line(reduced), soft_wrap=True)
        if sampler.router_first is not None and sampler.router_last is not None:
            hop = stage_means(sampler.router_first, sampler.router_last, rs.time_scale)
            reduced["router_mean_model_s"] = hop
            console.print("router means (model s): " + ", ".join(f"{k} {v:.3f}" for k, v in hop.items()), soft_wrap=True)
        summary["engine_timeline"] = reduced
    return summary


def _parse_scales(value: str | None) -> list[float]:
    if not value:
        return []
    try:
        scales = sorted({float(x) for x in value.split(",") if x.strip()})
    except ValueError:
        raise typer.BadParameter(f"{value!r}: expected comma-separated numbers", param_hint="--sweep") from None
    if not scales or scales[0] <= 0:
        raise typer.BadParameter("rate scales must be > 0", param_hint="--sweep")
    return scales


@contextlib.contextmanager
def _compare_interrupted(summaries: dict[str, dict[str, object]], total_runs: int, base: Path,
                         json_out: Path | None, plot: Path | None,
                         show_finished: Callable[[], None] | None = None) -> Iterator[None]:
    """Ctrl-C (or SIGTERM/SIGHUP) during ``compare``: the meshes are already stopped by their ``with``;
    the finished runs' table is printed (``show_finished``, when any run finished), then what was and was not
    written, exit 130 (128 + SIGINT, as a shell reports it). Further signals are ignored by then
    (``exit_on_signals(then_ignore=True)``)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        how = _how_interrupted(exc)
        unwritten = [str(p) for p in (json_out, plot) if p is not None]
        shown = False
        if summaries and show_finished is not None:
            try:
                show_finished()
                shown = True
            except Exception:  # a partial table is a courtesy: never hide the interrupt behind its failure
                logging.getLogger(__name__).debug("the finished runs' table could not be printed", exc_info=True)
        err_console.print(
            f"interrupted ({how}): {len(summaries)} of {total_runs} runs finished ({', '.join(summaries) or 'none'}), "
            f"every mesh stopped; " + ("their table is above (not the comparison)" if shown else "no table printed")
            + (f", nothing written to {' or '.join(unwritten)}" if unwritten else "")
            + f"; the runs' logs are in {base}", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(130) from None


@app.command()
@exits_130_when_interrupted
def compare(
    policies: Annotated[str, typer.Option("--policies", help="Comma-separated epp scheduling configs, each "
                                          "optionally NAME+OFFLOAD to give that column its own engines' offload "
                                          "(precise-prefix+cpu, tier-cost+cpu+kv_store, round-robin+off); plain "
                                          "names take --offload. The column is labelled NAME+OFFLOAD unless off."
                                          )] = "round-robin,tier-cost",
    trace: TraceOpt = None,
    workload: WorkloadOpt = DEFAULT_WORKLOAD,
    requests: RequestsOpt = DEFAULT_REQUESTS,
    seed: SeedOpt = 0,
    engines: EnginesOpt = DEFAULT_ENGINES,
    num_gpu_blocks: AutoBlocksOpt = None,
    block_size_tokens: BlockSizeOpt = None,
    max_num_seqs: MaxSeqsOpt = None,
    time_scale: TimeScaleOpt = DEFAULT_TIME_SCALE,
    concurrency_limit: ConcurrencyOpt = DEFAULT_CONCURRENCY,
    max_input_tokens: MaxInOpt = None,
    max_output_tokens: MaxOutOpt = DEFAULT_MAX_OUTPUT_TOKENS,
    rate_scale: RateScaleOpt = DEFAULT_RATE_SCALE,
    sessions: SessionsOpt = None,
    slo_ttft: SloTtftOpt = DEFAULT_SLO_TTFT_S,
    block_tokens: BlockTokensOpt = AgenticParams.block_tokens,
    session_gap: SessionGapOpt = AgenticParams.session_gap_s,
    max_think: MaxThinkOpt = AgenticParams.max_think_s or 60.0,
    peers: Annotated[str, typer.Option("--peers", help="Comma-separated peer routers over the same simulated engines "
                                       f"(`make peers-env`): {', '.join(PEERS)}; NAME+OFFLOAD as in --policies."
                                       )] = "",
    sweep: Annotated[str | None, typer.Option("--sweep", help="Comma-separated rate scales: run every policy and peer "
                                              "at each, print throughput vs TTFT and each one's goodput (the "
                                              "throughput where TTFT p90 crosses --slo-ttft); --plot draws the curve."
                                              )] = None,
    etcd: EtcdOpt = None,
    run_dir: RunDirOpt = None,
    json_out: JsonOutOpt = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write a PNG (needs matplotlib): bars per policy, or the "
                                              "sweep's curve.")] = None,
    offload: OffloadOpt = "off",
    timeline: Annotated[Path | None, typer.Option("--timeline", help="Sample every engine's waiting / running / KV "
                                                  f"usage / preemptions every {TIMELINE_INTERVAL_S:g} wall s during "
                                                  "each run; print a summary line per run and write the samples as "
                                                  "JSON lines into this folder.")] = None,
    repeat: Annotated[int, typer.Option("--repeat", min=1, max=20, help="Run every column this many times, the "
                                        "columns interleaved and their order rotated each round; the table shows "
                                        "each metric's median over the rounds, a second table its range, and the "
                                        "JSON keeps every round under 'rounds' (one run says little where runs of "
                                        "one column differ by more than the columns do). Not with --sweep.")] = 1,
    parallel: Annotated[bool, typer.Option("--parallel", help="Run each rate's columns at the same time, each on its "
                                           "own mesh, so they share whatever else loads the host (a fair A/B on a "
                                           "busy machine; each column gets a share of the CPU).")] = False,
    long_prefill_token_threshold: LongPrefillOpt = None,
    long_prefill_token_threshold_adaptive: LongPrefillAdaptiveOpt = False,
    scheduler_reserve_full_isl: ReserveFullIslOpt = None,
    api_key: ApiKeyOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Replay one workload against a fresh mesh per routing policy (and peer router) and print them side by side."""
    _setup_logging(verbose)
    # output paths first: a run of minutes must not end in a write that could never succeed
    json_out = None if json_out is None else check_output_file(json_out, "--json-out")
    plot = None if plot is None else _check_plot_format(check_output_file(plot, "--plot"))
    timeline = None if timeline is None else check_dir_option(timeline, "--timeline")
    run_dir = None if run_dir is None else check_dir_option(run_dir, "--run-dir")
    columns = compare_columns(policies, peers, _offload_mode(offload))
    scales = _parse_scales(sweep)
    if scales and repeat > 1:
        raise typer.BadParameter("--repeat cannot be combined with --sweep (run the sweep again instead)",
                                 param_hint="--repeat")
    agentic = AgenticParams(block_tokens=block_tokens, session_gap_s=session_gap, max_think_s=max_think)
    base_wl = build_workload(trace, workload, requests, seed, max_input_tokens, max_output_tokens, agentic)
    label = base_wl.name if trace is None else trace.name
    if sessions is None and base_wl.name.startswith("agentic"):
        sessions = DEFAULT_AGENTIC_SESSIONS_PER_ENGINE * engines
    rs = RunSettings(engines, num_gpu_blocks or default_num_gpu_blocks(trace, workload), block_size_tokens,
                     max_num_seqs, time_scale, concurrency_limit, sessions, slo_ttft, etcd, parallel,
                     long_prefill_token_threshold, long_prefill_token_threshold_adaptive, scheduler_reserve_full_isl,
                     api_key)
    bs = block_size_tokens or SIMULATOR_DEFAULTS.block_size_tokens
    scheduler_settings = engine_scheduler(long_prefill_token_threshold, long_prefill_token_threshold_adaptive,
                                          min(SIMULATOR_DEFAULTS.max_model_len, (rs.num_gpu_blocks - 1) * bs),
                                          scheduler_reserve_full_isl)
    longest = max((r.input_length + 1 + r.max_tokens for r in base_wl.requests), default=0)
    if -(-longest // bs) > rs.num_gpu_blocks - 1:
        raise typer.BadParameter(
            f"the longest request needs {-(-longest // bs)} KV blocks of {bs} tokens; an engine has "
            f"{rs.num_gpu_blocks - 1}: raise it or lower --max-input-tokens", param_hint="--num-gpu-blocks")
    base = _run_dir(run_dir, "compare")
    console.print(_workload_line(base_wl, label, None if trace else workload), soft_wrap=True, markup=False)
    console.print(f"{_count(engines, 'engine')} x {rs.num_gpu_blocks} blocks of "
                  f"{block_size_tokens or SIMULATOR_DEFAULTS.block_size_tokens} tokens, time scale "
                  f"{time_scale}, rate scale {sweep if scales else rate_scale}"
                  f"{f', {sessions} sessions' if sessions else ''}{engine_scheduler_label(scheduler_settings)}, "
                  f"logs in {base}", soft_wrap=True)
    summaries: dict[str, dict[str, object]] = {}
    rounds: dict[str, list[dict[str, object]]] = {}
    curves: dict[str, list[SweepPoint]] = {}
    total_runs = len(scales or [rate_scale]) * len(columns) * repeat
    def show_finished() -> None:
        """The finished runs' table (an interrupted compare): what was measured is not thrown away."""
        doc = compare_document(label, engines, len(base_wl.requests), summaries)
        print_table(console, summary_table(doc["policies"],  # type: ignore[arg-type]
                                           f"{label}: finished runs only (interrupted)"))

    with (_compare_interrupted(summaries, total_runs, base, json_out, plot, show_finished),
          exit_on_signals(then_ignore=True), mesh_errors()):
        for k, scale in enumerate(scales or [rate_scale]):
            wl = scale_load(base_wl, scale)
            for rnd in range(repeat):
                runs: list[tuple[str, str, Callable[[], dict[str, object]]]] = []
                order = columns[rnd % len(columns):] + columns[:rnd % len(columns)]  # rotated: no column always first
                for col in order:
                    i = columns.index(col)
                    name = col.name
                    tag = f"{name} x{scale:g}" if scales else name
                    stem = Path(col.policy or col.peer or name).stem
                    run_name = f"{k}-{i}-{column_label(stem, col.offload)}" + (f"-r{rnd + 1}" if repeat > 1 else "")
                    run_tag = f"{tag} (round {rnd + 1}/{repeat})" if repeat > 1 else tag
                    runs.append((name, tag, functools.partial(
                        _run_one, wl, rs, base / run_name, run_tag, col.policy, col.peer, run_tag, col.offload,
                        timeline=None if timeline is None else timeline / f"{run_name}.jsonl")))

                def record(name: str, tag: str, summary: dict[str, object], scale: float = scale) -> None:
                    """A finished run's column, kept at once: an interrupt later still shows it (with --repeat,
                    the median of the rounds finished so far)."""
                    key = tag if scales else name
                    rounds.setdefault(key, []).append(summary)
                    summaries[key] = median_summary(rounds[key]) if repeat > 1 else summary
                    if repeat == 1:
                        curves.setdefault(name, []).append(SweepPoint(
                            scale, float(summary.get("requests_per_s") or 0.0), summary.get("ttft_p90_s"),  # type: ignore[arg-type]
                            summary.get("ttft_p50_s"), summary.get("output_tokens_per_s")))  # type: ignore[arg-type]

                if parallel:
                    with ThreadPoolExecutor(len(runs)) as pool:
                        futures = [pool.submit(run) for _, _, run in runs]
                        done = [f.result() for f in futures]
                    for (name, tag, _), summary in zip(runs, done, strict=True):
                        record(name, tag, summary)
                else:
                    for name, tag, run in runs:
                        record(name, tag, run())
        summaries = {c.name: summaries[c.name] for c in columns} if not scales else summaries  # columns' order
    extra: dict[str, object] = {"rate_scale": rate_scale, "sessions": sessions, "slo_ttft_s": slo_ttft,
                                "offload": {c.name: c.offload for c in columns},
                                "engine_scheduler": scheduler_settings}
    if repeat > 1:
        extra["repeat"] = repeat
        extra["rounds"] = {name: [compare_document(label, engines, len(base_wl.requests), {name: r})["policies"][name]  # type: ignore[index]
                                  for r in per_round] for name, per_round in rounds.items()}
    if scales:
        extra["sweep"] = {name: {"points": [p.__dict__ for p in pts], "goodput_rps": slo_throughput(pts, slo_ttft),
                                 "slo_crossed": slo_crossed(pts, slo_ttft)}
                          for name, pts in curves.items()}
    doc = compare_document(label, engines, len(base_wl.requests), summaries, **extra)
    title = (f"{label}: {_count(len(base_wl.requests), 'request')}, {_count(engines, 'engine')}"
             f"{engine_scheduler_label(scheduler_settings)}")
    print_table(console, summary_table(doc["policies"], f"{title}: median of {repeat} rounds" if repeat > 1 else title))  # type: ignore[arg-type]
    if repeat > 1:
        print_table(console, spread_table({name: rounds[name] for name in summaries}, f"{title}: over {repeat} rounds",
                                          slo_ttft))
    if scales:
        print_table(console, sweep_table(curves, slo_ttft, f"{title}: load sweep"))
    ok = True
    if json_out is not None:
        text = json.dumps(doc, indent=2) + "\n"
        if _write_output(json_out, lambda p: p.write_text(text), "the results", fallback=base / "compare.json"):
            console.print(f"wrote {json_out}")
        else:
            ok = False
    if plot is not None:
        drawn: list[bool] = []

        def draw(path: Path) -> None:
            drawn.append(write_sweep_plot(curves, slo_ttft, title, path) if scales else write_plot(doc, path))

        if _write_output(plot, draw, "the plot", fallback=base / f"compare{plot.suffix or '.png'}"):
            console.print(f"wrote {plot}" if drawn[-1] else
                          "matplotlib is not installed; no plot (pip install matplotlib)")
        else:
            ok = False
    if not ok:
        raise typer.Exit(1)


@dataclass(frozen=True)
class _Col:
    """A column of a ``kvmesh flows`` table: its header, and when it goes on a narrow terminal (0: never; the
    highest first)."""

    header: str
    drop: int = 0
    short: str | None = None
    """The header on a narrow terminal (tried before any column is dropped); None: ``header``."""
    numeric: bool = True
    fold: bool = False
    """The one column that may fold over lines (a fairness id): shown whole, never cut with an ellipsis."""


def _fitted(title: str, columns: list[_Col], rows: list[list[str]], width: int | None,
            caption: str | None = None) -> Table:
    """A table of ``rows`` whose natural width fits ``width`` columns (None: all columns, as wide as it needs):
    first the short headers, then the droppable columns go, highest ``drop`` first, until it fits; headers never
    wrap and no cell is cut (a fairness id longer than the whole width folds)."""
    keep = list(range(len(columns)))
    measure = Console(width=10_000, file=io.StringIO())

    def build(short: bool) -> Table:
        table = Table(title=title, caption=caption, caption_justify="left")
        for i in keep:
            col = columns[i]
            table.add_column((col.short or col.header) if short else col.header,
                             justify="right" if col.numeric else "left", no_wrap=not col.fold, overflow="fold")
        for row in rows:
            table.add_row(*(row[i] for i in keep))
        return table

    def fits(table: Table) -> bool:
        return width is None or Measurement.get(measure, measure.options, table).maximum <= width

    table = build(short=False)
    if fits(table):
        return table
    table = build(short=True)
    while not fits(table):
        droppable = [i for i in keep if columns[i].drop]
        if not droppable:
            if len(rows) == 1:  # one row (the summary): "header value" lines, every column, fit any width
                table = Table(title=title, caption=caption, caption_justify="left", show_header=False)
                table.add_column(no_wrap=True)
                table.add_column(justify="right", overflow="fold")
                for col, value in zip(columns, rows[0], strict=True):
                    table.add_row(col.header, value)
            break
        keep.remove(max(droppable, key=lambda i: columns[i].drop))
        table = build(short=True)
    return table


def _pool_state(sat: object) -> tuple[str, str]:
    """flow_control's pool signal (a ``Saturation``) as a short cell (``0.93 SATURATED``, ``STALE``, ``off``) and
    the sentence that explains it (the table's caption)."""
    s = sat  # kvmesh.flow_control.v1.Saturation
    if not s.enabled:  # type: ignore[attr-defined]
        return "off", "pool: no saturation signal (max_in_flight only)"
    if s.stale:  # type: ignore[attr-defined]
        age = "none yet" if s.metrics_age_seconds > 1e9 else f"{s.metrics_age_seconds:.1f} s old"  # type: ignore[attr-defined]
        return "STALE", f"pool: STALE metrics ({age}): failing open"
    cell = f"{s.saturation:.2f}{' SATURATED' if s.saturated else ''}"  # type: ignore[attr-defined]
    return cell, f"pool: saturation {cell} (headroom {s.headroom:.0f}, unseen dispatches {s.unseen_dispatches})"  # type: ignore[attr-defined]


def flows_tables(stats: object, width: int | None = None) -> list[Table]:
    """Rich tables of a flow_control ``StatsResponse``: summary (the pool signal explained in its caption), bands,
    flows (``kvmesh flows``). ``width``: fit each in that many columns (a terminal's width), dropping the
    columns of least use first (queued bytes, dispatched; in a flow: served tokens, oldest wait, in flight);
    None: every column."""
    st = stats  # kvmesh.flow_control.v1.StatsResponse
    cell, pool = _pool_state(st.saturation)  # type: ignore[attr-defined]
    summary = _fitted(
        "flow_control",
        [_Col("in flight"), _Col("queued"), _Col("queued bytes", drop=2, short="q bytes"),
         _Col("dispatched", drop=1, short="disp."),
         _Col("rejected"), _Col("saturation", numeric=False), _Col(f"Jain ({st.fairness_window_seconds:g} s)")],  # type: ignore[attr-defined]
        [[f"{st.in_flight}/{st.max_in_flight}", str(st.queued), str(st.queued_bytes), str(st.dispatched_total),  # type: ignore[attr-defined]
          str(st.rejected_total), cell, f"{st.jain_index:.3f}"]],  # type: ignore[attr-defined]
        width, caption=pool)
    bands = _fitted(
        "bands (highest first)",
        [_Col("priority", short="prio"), _Col("name", numeric=False, fold=True), _Col("queued"),
         _Col("queued bytes", drop=2, short="q bytes"),
         _Col("in flight"), _Col("flows", drop=1)],
        [[str(b.priority), b.name, str(b.queued), str(b.queued_bytes), str(b.in_flight), str(b.flows)]
         for b in st.bands],  # type: ignore[attr-defined]
        width)
    flows = _fitted(
        "flows",
        [_Col("fairness id", numeric=False, fold=True), _Col("priority", short="prio"), _Col("queued"),
         _Col("in flight", drop=1), _Col("oldest wait s", drop=2, short="wait s"),
         _Col("served tokens", drop=3, short="tokens"), _Col("share")],
        [[f.flow_id, str(f.priority), str(f.queued), str(f.in_flight), f"{f.oldest_wait_seconds:.2f}",
          str(f.served_tokens), f"{f.share:.1%}"]
         for f in sorted(st.flows, key=lambda f: (-f.priority, -f.served_tokens, f.flow_id))],  # type: ignore[attr-defined]
        width)
    return [summary, bands, flows]


async def _flow_stats(address: str, timeout: float) -> object:
    from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        return await flow_control_pb2_grpc.FlowControlStub(channel).Stats(flow_control_pb2.StatsRequest(), timeout=timeout)


def flow_stats_error(address: str, exc: grpc.RpcError, hint: str = "") -> str:
    """One line saying why ``address`` gave no flow_control ``Stats``: not a flow_control (UNIMPLEMENTED: another
    gRPC service answered), a host name that did not resolve, nothing listening, or the status as is."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"{address} is a gRPC server but not a flow_control (it does not implement "
                f"kvmesh.flow_control.v1.FlowControl/Stats){hint}")
    if code == grpc.StatusCode.UNAVAILABLE:
        import socket

        host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError) as gai:
            return f"flow_control at {address}: the host name {host!r} did not resolve ({gai}){hint}"
        if "refused" in details.lower():
            return f"flow_control at {address}: nothing listens there (connection refused){hint}"
        return f"flow_control at {address} is unreachable (UNAVAILABLE: {details or 'no answer'}){hint}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"flow_control at {address} did not answer Stats in time (DEADLINE_EXCEEDED){hint}"
    name = code.name if code is not None else type(exc).__name__
    return f"flow_control at {address} did not answer Stats: {name}{f' ({details})' if details else ''}{hint}"


DEFAULT_FLOW_CONTROL = "127.0.0.1:50054"
"""flow_control's gRPC address in the compose deployment (compose/docker-compose.yml, docs/compose.md)."""


def flow_control_address(flow_control: str | None, etcd: str | None) -> str:
    """``--flow-control`` as given, else the flow_control registered in ``--etcd``, else the compose
    default :data:`DEFAULT_FLOW_CONTROL` (``kvmesh up`` prints its own on the ``kvmesh ready`` line)."""
    if flow_control:
        return flow_control
    if not etcd:
        return DEFAULT_FLOW_CONTROL
    from kvmesh_cli.discovery import DiscoveryError, services_from_etcd

    try:
        found = services_from_etcd(etcd, "flow_control",
                                   hint="pass the etcd the mesh registers in (kvmesh up prints it), or --flow-control")
    except (DiscoveryError, ValueError) as exc:
        fail(str(exc))
    if not found:
        fail(f"no flow_control registered in etcd {etcd}; pass --flow-control HOST:PORT")
    if len(found) > 1:
        err_console.print(f"{len(found)} flow_control instances registered in etcd {etcd}: showing {found[0]} "
                      f"(others: {', '.join(found[1:])})", soft_wrap=True, markup=False)
    return found[0]


@app.command()
@exits_130_when_interrupted
def flows(
    flow_control: Annotated[str | None, typer.Option(
        "--flow-control", help=f"host:port of flow_control's gRPC API (default: the one registered in --etcd, "
        f"else {DEFAULT_FLOW_CONTROL}, compose's; `kvmesh up` prints its own on the `kvmesh ready` line).")] = None,
    etcd: Annotated[str | None, typer.Option(
        "--etcd", callback=check_etcd_address,
        help="host:port of the mesh's etcd: find flow_control registered there.")] = None,
    watch: Annotated[float, typer.Option("--watch", help="Refresh every SECONDS (0: print once).", min=0)] = 0.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print the Stats reply as JSON.")] = False,
) -> None:
    """Bands, flows, saturation and fairness (each flow's share, Jain's index) of a running flow_control."""
    from google.protobuf.json_format import MessageToDict
    from rich.console import Group, RenderableType
    from rich.live import Live
    from rich.text import Text

    hint = "" if flow_control or etcd else (" (the compose default; for `kvmesh up` pass --etcd or "
                                             "--flow-control from its `kvmesh ready` line)")
    address, first = "", None

    def width() -> int | None:
        """A terminal's width, read at each refresh (a resized window); piped: None (every column, unwrapped)."""
        return console.width if console.is_terminal else None

    def fetch() -> object:
        try:
            return run_interruptible(_flow_stats(address, 5.0))
        except grpc.RpcError as exc:
            fail(flow_stats_error(address, exc, hint))

    def watched() -> list[RenderableType]:
        """The tables, or (flow_control down or restarting) a line saying so: a watch keeps watching."""
        try:
            return [*flows_tables(run_interruptible(_flow_stats(address, min(5.0, max(watch, 1.0)))), width())]
        except grpc.RpcError as exc:
            return [Text(f"{time.strftime('%H:%M:%S')} DOWN: {flow_stats_error(address, exc)}; retrying every "
                         f"{watch:g} s (Ctrl-C to stop)", style="bold red")]

    # Ctrl-C (or SIGTERM/SIGHUP) ends it wherever it lands, exit 130 as replay and compare: finding flow_control
    # in etcd, the first fetch (up to 5 s on an address that never answers), a sleep or a later fetch. In a
    # sleep it is raised there; in a fetch the fetch's event loop is stopped by cancelling it
    # (run_interruptible), never by raising inside a grpc call.
    try:
        with exit_on_signals(then_ignore=True):
            address = flow_control_address(flow_control, etcd)
            first = fetch()  # the first fetch fails loudly: a wrong address is a usage mistake, not an outage
            if json_out:
                console.print_json(json.dumps(MessageToDict(first, always_print_fields_with_no_presence=True)))
                return
            if not watch:
                for table in flows_tables(first, width()):
                    print_table(console, table)
                return
            if not console.is_terminal:  # piped or logged: one snapshot after another (a Live shows only its last)
                shown: list[RenderableType] = [*flows_tables(first, width())]
                while True:
                    console.print(Text(time.strftime("%H:%M:%S"), style="dim"))
                    for part in shown:  # a table whole, unwrapped (a log is read later, at any width)
                        print_table(console, part) if isinstance(part, Table) else console.print(part)
                    time.sleep(watch)
                    shown = watched()
            with Live(Group(*flows_tables(first, width())), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(watch)
                    live.update(Group(*watched()))
    except KeyboardInterrupt as exc:
        how = _how_interrupted(exc)
        what = ("the watch stopped" if watch else "stopped while printing" if first is not None
                else f"no answer from flow_control{' at ' + address if address else ''}")
        err_console.print(f"interrupted ({how}): {what}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None


if __name__ == "__main__":
    app()
