"""epp's ``epp.Pick`` span on the ``PickMany`` stream (issue 11's attributes; issue 10 wave 10 moved its
annotation and end after the result's write): the router's real ``PickerClient`` against the real
servicer and scheduler on a loopback gRPC server, OpenTelemetry's SDK with an in-memory exporter.

The span is the pick's: a child of the router's span, current while the pick runs (a span the pick
starts, as the kv_indexer ``Score`` client's, is its child), annotated with the chosen endpoint and
its scores, and ending when the decision was made (before the router read the result), although it
is annotated and ended only once the writer has sent the result.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.types import Endpoint, EndpointId
from services.epp import servicer as servicer_module
from services.epp.framework.interfaces import PrefixMatch
from services.epp.servicer import EndpointPickerServicer
from services.router.clients import PickQuery
from tests.unit.epp._support import real_scheduler
from tests.unit.router.test_pick_many import _client, _serve

ENDPOINTS = [Endpoint(id=EndpointId(f"127.0.0.1:{9100 + i}"), url=f"http://127.0.0.1:{9100 + i}", model="m")
             for i in range(3)]


class _Index:
    """kv_indexer stand-in: starts a span under the current context, as the ``Score`` client's interceptor does."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        with self._tracer.start_as_current_span("kv_indexer.Score", kind=trace.SpanKind.CLIENT):
            return PrefixMatch(len(token_ids) // 16, {})


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> tuple[InMemorySpanExporter, trace.Tracer]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracer = provider.get_tracer("kvmesh.epp")
    monkeypatch.setattr(servicer_module, "_tracer", tracer)
    return spans, tracer


async def test_the_pick_span_is_the_picks_although_it_ends_after_the_write(
        exporter: tuple[InMemorySpanExporter, trace.Tracer]) -> None:
    spans, tracer = exporter
    scheduler, _ = real_scheduler(ENDPOINTS, _Index(tracer))
    server, port = await _serve(EndpointPickerServicer(scheduler))
    client = await _client(port)
    router_span = TracerProvider().get_tracer("router").start_span("router.request")
    try:
        with trace.use_span(router_span, end_on_exit=True):
            for i in range(3):
                reply = await client.pick(PickQuery(f"req-{i}", "m", prompt_token_ids=tuple(range(64 * (i + 1)))))
                received = time.time_ns()
                for _ in range(500):  # annotated and ended by the writer once its write returned
                    picks = [s for s in spans.get_finished_spans() if s.name == "epp.Pick"]
                    if len(picks) == i + 1:
                        break
                    await asyncio.sleep(0.01)
                pick = picks[i]
                assert pick.end_time is not None and pick.start_time is not None
                assert pick.start_time <= pick.end_time <= received  # it ended at the decision
                assert pick.kind is trace.SpanKind.SERVER
                assert pick.parent is not None
                assert pick.parent.span_id == router_span.get_span_context().span_id
                assert pick.context.trace_id == router_span.get_span_context().trace_id
                attributes = dict(pick.attributes or {})
                assert attributes["kvmesh.request_id"] == f"req-{i}"
                assert attributes["kvmesh.model"] == "m"
                assert attributes["kvmesh.endpoint"] == reply.candidates[0].id
                assert attributes["kvmesh.profile"] == reply.profile
                assert "kvmesh.score.total" in attributes and "kvmesh.score.prefix" in attributes
                (score,) = [s for s in spans.get_finished_spans() if s.name == "kv_indexer.Score"][i:i + 1]
                assert score.parent is not None and score.parent.span_id == pick.context.span_id  # current during the pick
    finally:
        await client.close()
        await server.stop(0)
