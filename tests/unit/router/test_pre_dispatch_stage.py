"""The router's ``pre_dispatch`` stage (``kvmesh_router_stage_duration_seconds{stage="pre_dispatch"}``):
arrival to the first POST to an engine, measured. With the early pick (the Pick started beside
admission) the ``admission`` and ``pick`` stages overlap and their sum over-counts the time before
dispatch; ``kvmesh compare``'s ``mesh_pre_dispatch_mean_s`` reads this stage instead
(kvmesh_cli/report.py ``ttft_breakdown``)."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import REGISTRY

from services.router.clients import PickQuery, PickReply
from services.router.config import RouterConfig
from services.router.request_flow import RequestFlow, RequestMeta
from services.router.validation import RequestKind, validate_request
from tests.unit.router.fakes import CATALOG, SSE, A, FakeAdmission, FakePicker

_DELAY = 0.05
"""Seconds the admission and the pick each take (asyncio sleeps, so they can overlap)."""


class _SlowPicker(FakePicker):
    async def pick(self, query: PickQuery) -> PickReply:
        await asyncio.sleep(_DELAY)
        return await super().pick(query)


def _stage(name: str) -> tuple[float, float]:
    total = REGISTRY.get_sample_value("kvmesh_router_stage_duration_seconds_sum", {"stage": name}) or 0.0
    count = REGISTRY.get_sample_value("kvmesh_router_stage_duration_seconds_count", {"stage": name}) or 0.0
    return total, count


async def _means(early_pick: bool, requests: int = 6) -> dict[str, tuple[float, float]]:
    """``{stage: (mean seconds, observations)}`` of admission, pick and pre_dispatch over ``requests``."""
    answer = httpx.MockTransport(lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, content=SSE))
    flow = RequestFlow(RouterConfig(etcd_endpoints=[], early_pick=early_pick), lambda: CATALOG,
                       FakeAdmission(delay=_DELAY), _SlowPicker((A,)), httpx.AsyncClient(transport=answer))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}
    request = validate_request(RequestKind.COMPLETION, body, CATALOG, 1024)
    stages = ("admission", "pick", "pre_dispatch")
    before = {s: _stage(s) for s in stages}
    try:
        for i in range(requests):
            async with flow.session(request, RequestMeta(request_id=f"r{i}", flow_id="f", priority=0)) as session:
                async for _ in session.iter_events():
                    pass
    finally:
        await flow.aclose()
    out = {}
    for s in stages:
        (t0, c0), (t1, c1) = before[s], _stage(s)
        out[s] = ((t1 - t0) / (c1 - c0) if c1 > c0 else 0.0, c1 - c0)
    return out


async def test_pre_dispatch_measures_the_overlap_of_admission_and_the_early_pick() -> None:
    means = await _means(early_pick=True)
    (admission, n_admission), (pick, n_pick), (pre, n_pre) = means["admission"], means["pick"], means["pre_dispatch"]
    assert n_admission == n_pick == n_pre == 6, means
    assert pre >= admission  # the request is sent after it was admitted
    # the pick ran beside admission: before dispatch took about one delay, not the two stages' sum
    assert pre < admission + pick - _DELAY / 2, means


async def test_without_the_early_pick_pre_dispatch_is_the_two_stages_in_turn() -> None:
    means = await _means(early_pick=False)
    (admission, _), (pick, _), (pre, n_pre) = means["admission"], means["pick"], means["pre_dispatch"]
    assert n_pre == 6
    assert pre >= admission + pick - 0.001, means  # one after the other (timer granularity aside)
