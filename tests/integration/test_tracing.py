"""One HTTP request through the mesh yields one trace with spans from every service on its path.

An in-process OTLP receiver (``opentelemetry-proto``'s TraceService on a real gRPC server) collects
what the services export when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, as a user's collector would.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans as (service.name, span name, trace id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, bytes]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"),
                    "",
                )
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append((service, span.name, span.trace_id))
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def otlp_receiver() -> Iterator[tuple[Receiver, str]]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield receiver, f"http://127.0.0.1:{port}"
    server.stop(0)


def test_one_request_one_trace_across_services(start_service, etcd: str, run_dir: Path, otlp_receiver) -> None:
    receiver, endpoint = otlp_receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    events_port = free_port()
    _, indexer = start_service("kv_indexer", "--events-bind-endpoint", f"tcp://127.0.0.1:{events_port}", env=env)
    _, flow = start_service("flow_control", env=env)
    _, epp = start_service(
        "epp", "--kv-indexer-address", indexer, "--scheduling-config", "precise-prefix", env=env
    )
    engine_port = free_port()
    engine = ManagedProcess(
        "engine",
        python_module(
            "engine_simulator", "--host", "127.0.0.1", "--port", str(engine_port), "--model", "sim",
            "--events-endpoint", f"tcp://127.0.0.1:{events_port}", "--etcd-endpoints", etcd,
            "--lease-ttl-seconds", "3", "--time-scale", "50",
        ),
        run_dir / f"engine-{engine_port}.log",
    ).start()
    http_port = free_port()
    try:
        wait_http_ok(f"http://127.0.0.1:{engine_port}/health", 60)
        start_service(
            "router", "--http-port", str(http_port), "--flow-control-address", flow, "--epp-address", epp, env=env
        )
        base = f"http://127.0.0.1:{http_port}"
        # The router learns the model from etcd.
        wait_until(lambda: httpx.get(f"{base}/v1/models").json().get("data"), 30, "the router to list the model")
        reply = httpx.post(
            f"{base}/v1/completions",
            json={"model": "sim", "prompt": "hello tracing " * 40, "max_tokens": 4},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text

        wanted = {"kvmesh-router", "kvmesh-flow_control", "kvmesh-epp", "kvmesh-kv_indexer"}

        def services_by_trace() -> dict[bytes, set[str]]:
            by_trace: dict[bytes, set[str]] = defaultdict(set)
            with receiver.lock:
                for service, _name, trace_id in receiver.spans:
                    by_trace[trace_id].add(service)
            return dict(by_trace)

        by_trace = wait_until(
            services_by_trace,
            20,
            f"one trace spanning all of {sorted(wanted)}",
            until=lambda traces: any(wanted <= services for services in traces.values()),
            interval=0.1,
        )
        complete = [t for t, services in by_trace.items() if wanted <= services]
        # The request's trace is one trace: the router's server span is its root.
        with receiver.lock:
            names = {(s, n) for s, n, t in receiver.spans if t == complete[0]}
        assert any(s == "kvmesh-epp" and "Pick" in n for s, n in names), names
        assert any(s == "kvmesh-kv_indexer" and "Score" in n for s, n in names), names
    finally:
        engine.stop()
