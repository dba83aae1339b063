"""Prometheus helpers shared by every service: the /metrics server and standard buckets."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)

# Explicit bucket sets (seconds) so dashboards line up across services and with vLLM's own.
TTFT_BUCKETS_SECONDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
LATENCY_BUCKETS_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)
FAST_BUCKETS_SECONDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint; ``port`` is the bound port."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread (port 0 = free port)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_port
    logger.info("metrics listening address=%s:%d", host, bound)
    return MetricsServer(bound, server, thread)
