"""Admission decision latency of the flow controller with 10,000 requests queued across 100 flows.

In-process (the controller is pure: no gRPC on this path). For each fairness x ordering policy:
fill the queue with ``--queued`` requests spread over ``--flows`` flows in 3 priority bands, then time
``--samples`` decisions of each kind with ``time.perf_counter_ns``:

* ``enqueue``: a new arrival that has to queue (the full arrival path: TTL sweep, band/flow
  lookup, quota and capacity checks, push), immediately cancelled so the queue stays at its size;
* ``dispatch``: a release that frees a slot and dispatches the next request (band order, the
  fairness pick, the ordering pop, TTL re-check), followed by an arrival that refills the queue.

Target (issue 12): p99 <= 1 ms. Prints a table; ``--plot PATH`` writes a PNG.

    .venv/bin/python bench/flow_control_admission.py [--queued 10000 --flows 100 --samples 5000] [--plot out.png]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvmesh.clock import ManualClock
from services.flow_control.controller import ControllerLimits, FlowController, Ticket
from services.flow_control.policies import FAIRNESS_POLICIES, ORDERING_POLICIES
from services.flow_control.types import AdmissionRequest, QueueOutcome

BANDS = (10, 0, -5)


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def run(fairness: str, ordering: str, queued: int, flows: int, samples: int) -> dict[str, float]:
    clock = ManualClock(0.0)
    limits = ControllerLimits(max_in_flight=64, queue_ttl_seconds=3600.0, max_queue_size=queued + 10,
                              fairness_policy=fairness, ordering_policy=ordering)
    last: list[str] = []

    class LastDispatched:
        def on_outcome(self, request: AdmissionRequest, outcome: QueueOutcome, queue_seconds: float) -> None:
            if outcome is QueueOutcome.DISPATCHED:
                last.append(request.request_id)

        def on_state(self, queued: int, in_flight: int) -> None:
            pass

    controller = FlowController(limits, clock, observer=LastDispatched())
    tickets: dict[str, Ticket] = {}
    n = 0

    def request(i: int) -> AdmissionRequest:
        flow = i % flows
        return AdmissionRequest(request_id=str(i), flow_id=f"tenant-{flow}", priority=BANDS[flow % 2],  # bands 10 and 0
                                prompt_tokens=100 + i % 900, max_tokens=128, byte_size=2000,
                                ttl_seconds=600.0 + (i % 97), ttft_slo_seconds=1.0 + (i % 13) * 0.1)

    in_flight: list[Ticket] = []
    while len(in_flight) < limits.max_in_flight:
        in_flight.append(controller.enqueue(request(n)))
        n += 1
    for _ in range(queued):
        r = request(n)
        tickets[r.request_id] = controller.enqueue(r)
        n += 1
        clock.advance(1e-5)
    assert controller.stats().queued == queued
    gc.collect()
    gc.disable()
    enqueue_ns: list[float] = []
    dispatch_ns: list[float] = []
    try:
        for _ in range(samples):
            clock.advance(1e-5)
            r = request(n)
            n += 1
            t0 = time.perf_counter_ns()
            ticket = controller.enqueue(r)
            enqueue_ns.append(time.perf_counter_ns() - t0)
            controller.release(ticket)  # keep the queue at its size
            done = in_flight.pop(0)
            t0 = time.perf_counter_ns()
            controller.release(done)  # frees a slot: the next request is dispatched
            dispatch_ns.append(time.perf_counter_ns() - t0)
            in_flight.append(tickets.pop(last[-1]))
            r = request(n)
            tickets[r.request_id] = controller.enqueue(r)  # refill
            n += 1
    finally:
        gc.enable()
    assert controller.stats().queued == queued
    us = 1e-3
    return {
        "enqueue_p50_us": _p(enqueue_ns, 50) * us, "enqueue_p99_us": _p(enqueue_ns, 99) * us,
        "dispatch_p50_us": _p(dispatch_ns, 50) * us, "dispatch_p99_us": _p(dispatch_ns, 99) * us,
    }


def build_parser() -> argparse.ArgumentParser:
    """This script's command line; abbreviations (``--req`` for ``--requests``) are refused."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--queued", type=int, default=10_000)
    parser.add_argument("--flows", type=int, default=100)
    parser.add_argument("--samples", type=int, default=5_000)
    parser.add_argument("--plot", type=Path)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    rows = []
    for fairness in FAIRNESS_POLICIES:
        for ordering in ORDERING_POLICIES:
            rows.append((fairness, ordering, run(fairness, ordering, args.queued, args.flows, args.samples)))
    table = Table(title=f"admission decision latency, {args.queued} queued across {args.flows} flows (target p99 <= 1000 us)")
    for col in ("fairness", "ordering", "enqueue p50 us", "enqueue p99 us", "dispatch p50 us", "dispatch p99 us", "p99 <= 1 ms"):
        table.add_column(col)
    for fairness, ordering, r in rows:
        worst = max(r["enqueue_p99_us"], r["dispatch_p99_us"])
        table.add_row(fairness.removesuffix("-fairness-policy"), ordering.removesuffix("-ordering-policy"),
                      f"{r['enqueue_p50_us']:.1f}", f"{r['enqueue_p99_us']:.1f}", f"{r['dispatch_p50_us']:.1f}",
                      f"{r['dispatch_p99_us']:.1f}", "yes" if worst <= 1000 else "NO")
    Console().print(table)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{f.split('-')[0]}\n{o.split('-')[0]}" for f, o, _ in rows]
        fig, ax = plt.subplots(figsize=(10, 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["enqueue_p99_us"] for *_, r in rows], 0.4, label="enqueue p99")
        ax.bar([x + 0.2 for x in xs], [r["dispatch_p99_us"] for *_, r in rows], 0.4, label="dispatch p99")
        ax.axhline(1000, color="red", linestyle="--", label="target 1 ms")
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.set_ylabel("microseconds")
        ax.set_title(f"flow_control decision p99, {args.queued} queued / {args.flows} flows")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
