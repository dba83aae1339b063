"""Installed packages that share import paths leave the ones kvmesh needs intact.

xds-protos (Envoy's data-plane API, for epp's ext_proc) ships an old copy of opentelemetry-proto's
generated modules under the same paths; whichever installs last wins. ``make setup`` and the image's
Dockerfile reinstall opentelemetry-proto afterwards. Without that, the OTLP exporter every service
loads fails to import (``InstrumentationScope`` is missing) and no service starts.
"""

from __future__ import annotations

import importlib.metadata


def test_opentelemetry_proto_is_opentelemetrys_own() -> None:
    from opentelemetry.proto.common.v1 import common_pb2

    assert hasattr(common_pb2, "InstrumentationScope"), common_pb2.__file__
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401


def test_envoy_ext_proc_protos_import_beside_it() -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2

    assert external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert importlib.metadata.version("xds-protos")
