"""A service whose OTLP collector is unreachable: requests are not slowed, the dropped spans are logged
once (rate-limited), and SIGTERM still exits promptly (wave 13's fresh user: ~8-20 s before, the
exporter retrying with back-off at stop; now bounded by ``otlp_shutdown_timeout_seconds``, 1 s).

The dead collector is a real TCP port that refuses connections: a socket bound on 127.0.0.1 that never
listens (held for the test, so no one else can take the port meanwhile).
"""

from __future__ import annotations

import signal
import socket
import statistics
import time
from collections.abc import Iterator

import grpc
import pytest

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2 as pb
from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2_grpc as pb_grpc
from tests.support import wait_until

pytestmark = pytest.mark.integration

EXIT_BOUND_SECONDS = 5.0
"""Generous: the drain (~0.5 s) + the 1 s tracing bound + interpreter exit, on a loaded machine."""
DROPPED = "span(s) dropped: OTLP export to"
AT_STOP = "span(s) not exported at stop"


@pytest.fixture
def dead_collector() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` where a connection is refused (bound, not listening)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def _stats(address: str, calls: int) -> list[float]:
    """``calls`` traced unary RPCs (flow_control's Stats); each one's latency in seconds."""
    latencies = []
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.FlowControlStub(channel)
        for _ in range(calls):
            started = time.monotonic()
            stub.Stats(pb.StatsRequest(), timeout=10)
            latencies.append(time.monotonic() - started)
    return latencies


def test_sigterm_with_a_dead_collector_exits_promptly(start_service, dead_collector: str) -> None:
    # the default batch delay (5 s): the spans are still queued at SIGTERM, so the stop has a flush to do
    proc, address = start_service("flow_control", env={"OTEL_EXPORTER_OTLP_ENDPOINT": dead_collector})
    assert len(_stats(address, 50)) == 50
    assert proc.proc is not None
    started = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.proc.wait(timeout=30)
    except Exception:
        pytest.fail(f"flow_control still running 30 s after SIGTERM:\n{proc.log_tail()}")
    took = time.monotonic() - started
    log = proc.log_path.read_text(errors="replace")
    assert rc == 0, log[-3000:]
    assert took < EXIT_BOUND_SECONDS, f"exit took {took:.1f} s\n{log[-3000:]}"
    # the spans that could not be sent are counted, in one line, not lost silently
    lines = [line for line in log.splitlines() if AT_STOP in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and dead_collector in lines[0], log[-3000:]
    assert int(lines[0].split(AT_STOP)[0].split()[-1]) >= 50  # at least the 50 Stats calls' server spans
    assert "Traceback" not in log


def test_a_dead_collector_drops_spans_without_slowing_requests(start_service, dead_collector: str) -> None:
    # batches every 50 ms; each export tries, backs off ~1 s (0.8-1.2 s), tries again and gives up within 3 s:
    # a request that waited for an export would take >= 0.8 s
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": dead_collector, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "3"}
    proc, address = start_service("flow_control", env=env)
    latencies: list[float] = []

    def failed_exports_logged() -> int:
        latencies.extend(_stats(address, 20))
        return proc.log_path.read_text(errors="replace").count("Failed to export traces")

    # two failed exports (the SDK's ERROR line each), so the second one's WARNING is rate-limited away
    wait_until(failed_exports_logged, 30.0, "two failed OTLP exports", until=lambda n: n >= 2)
    log = proc.log_path.read_text(errors="replace")
    dropped = [line for line in log.splitlines() if DROPPED in line]
    assert len(dropped) == 1, log[-3000:]  # once: rate-limited (one per 60 s)
    assert "WARNING" in dropped[0] and dead_collector in dropped[0]
    assert statistics.median(latencies) < 0.2, f"median {statistics.median(latencies):.3f} s over {len(latencies)} calls"
    proc.check_alive()
