"""Fakes shared by the router's unit tests: an admission stream, epp, metric readers and engine answers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from prometheus_client import REGISTRY

from kvmesh import errors
from kvmesh.types import Endpoint, EndpointId
from services.router.catalog import ModelCatalog
from services.router.clients import AdmitQuery, CompletionReport, PickQuery, PickReply
from services.router.config import RouterConfig

MODEL = "tiny"
A = Endpoint(id=EndpointId("a:1"), url="http://a:1", model=MODEL, labels={"max_model_len": "256"})
B = Endpoint(id=EndpointId("b:1"), url="http://b:1", model=MODEL, labels={"max_model_len": "256"})
CATALOG = ModelCatalog.from_endpoints([A, B])
CONFIG = RouterConfig(etcd_endpoints=[])

SSE = (
    b'data: {"id":"c1","choices":[{"text":"he","finish_reason":null}]}\n\n'
    b'data: {"id":"c1","choices":[{"text":"llo","finish_reason":"length"}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    b"data: [DONE]\n\n"
)
JSON_BODY = json.dumps(
    {"id": "c1", "choices": [{"text": "hello", "finish_reason": "length"}], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
).encode()


@dataclass
class FakeTicket:
    reports: list[CompletionReport | None] = field(default_factory=list)

    async def close(self, report: CompletionReport | None = None) -> None:
        self.reports.append(report)


@dataclass
class FakeAdmission:
    reject: BaseException | None = None
    delay: float = 0.0
    tickets: list[FakeTicket] = field(default_factory=list)

    async def admit(self, request: AdmitQuery) -> FakeTicket:
        await asyncio.sleep(self.delay)
        if self.reject is not None:
            raise self.reject
        ticket = FakeTicket()
        self.tickets.append(ticket)
        return ticket


@dataclass
class FakePicker:
    order: tuple[Endpoint, ...] = (A, B)
    queries: list[PickQuery] = field(default_factory=list)

    async def pick(self, query: PickQuery) -> PickReply:
        self.queries.append(query)
        candidates = tuple(ep for ep in self.order if ep.id not in query.exclude_endpoint_ids)
        if not candidates:
            raise errors.NoEndpointsAvailable("nothing left")
        return PickReply(candidates, 0, "test")


def outcome_count(outcome: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_requests_total", {"outcome": outcome}) or 0.0


def in_flight() -> float:
    return REGISTRY.get_sample_value("kvmesh_router_requests_in_flight") or 0.0
