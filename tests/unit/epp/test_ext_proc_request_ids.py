"""epp's ext_proc path keeps two downstream requests that share an ``x-request-id`` apart (Envoy keeps
a client's id on internal or ``preserve_external_request_id`` requests): each stream's pick is counted
under its own id (``kvmesh.types.pick_request_id``), so the second does not supersede the first's
load. The servicer's ``Process`` driven in process as Envoy's buffered mode sends it, over a real
Scheduler and Datastore (the harness of ``test_ext_proc``)."""

from __future__ import annotations

import random

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2

from kvmesh.clock import ManualClock
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.ext_proc import ExternalProcessorServicer
from services.epp.framework.interfaces import PluginHandle
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler
from tests.unit.epp.test_ext_proc import BODY, ENDPOINTS, headers, protocol, routed, run

Mode = processing_mode_pb2.ProcessingMode


def test_two_requests_sharing_an_x_request_id_are_two_picks() -> None:
    ds = Datastore(ManualClock())
    ds.set_endpoints({e.id: e for e in ENDPOINTS})
    for e in ENDPOINTS:
        ds.record_scrape(e.id, ScrapeSample(0, 0, 0.0, 16))
    source, data = resolve_scheduling_config("load-only")
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0)), source)
    servicer = ExternalProcessorServicer(Scheduler(ds, profile, LiveEndpointFilter("live")), rng=random.Random(0))
    for _ in range(2):
        replies = run(servicer, [
            ext_pb2.ProcessingRequest(request_headers=headers({"x-request-id": "same"}),
                                      protocol_config=protocol(Mode.BUFFERED, Mode.NONE)),
            ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=BODY, end_of_stream=True)),
        ])
        assert routed(replies[-1], "request_body")[1] in {e.id for e in ENDPOINTS}
    assert sum(ds.picks_total(e.id) for e in ENDPOINTS) == 2  # before: the second superseded the first (1)
    assert len(ds._in_flight) == 2 and all(rid.startswith("same~") for rid in ds._in_flight)
