"""A stand-in for Jaeger in the compose-up check (Jaeger's image cannot be pulled here).

OTLP/gRPC in on 0.0.0.0:4317 (``opentelemetry-proto``'s TraceService, as Jaeger's collector
receives it) and a subset of Jaeger's query API out on 0.0.0.0:16686: ``GET /api/traces?service=S``
-> ``{"data": [{"traceID", "spans": [{"spanID", "operationName", "serviceName", "tags": {...}}]}]}``,
every trace that has a span from service S. ``GET /`` answers 200 (health). Runs in the kvmesh
image: ``python /sink/otlp_sink.py``. Users' compose file keeps the real Jaeger all-in-one.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

TRACES: dict[str, list[dict[str, Any]]] = defaultdict(list)
LOCK = threading.Lock()


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        with LOCK:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        TRACES[span.trace_id.hex()].append({
                            "spanID": span.span_id.hex(),
                            "parentSpanID": span.parent_span_id.hex(),
                            "operationName": span.name,
                            "serviceName": service,
                            "durationMicros": (span.end_time_unix_nano - span.start_time_unix_nano) // 1000,
                            "tags": {a.key: _value(a.value) for a in span.attributes},
                        })
        return trace_service_pb2.ExportTraceServiceResponse()


class Query(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urlparse(self.path)
        if url.path == "/api/traces":
            service = parse_qs(url.query).get("service", [""])[0]
            with LOCK:
                data = [{"traceID": t, "spans": list(spans)} for t, spans in TRACES.items()
                        if any(s["serviceName"] == service for s in spans)]
            body = json.dumps({"data": data}).encode()
        elif url.path == "/":
            body = b'{"status": "ok"}'
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    server.add_insecure_port("0.0.0.0:4317")
    server.start()
    print("otlp sink: OTLP/gRPC on :4317, query API on :16686", flush=True)
    ThreadingHTTPServer(("0.0.0.0", 16686), Query).serve_forever()


if __name__ == "__main__":
    main()
