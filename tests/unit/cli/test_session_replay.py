"""Closed-loop session timing of ``kvmesh_cli.replay.replay`` against a scripted router (answers after a
fixed delay): a call goes out its think time after the previous answer, a session cap holds a session's
first call until a slot frees, and the text form goes out to routers that need it. Also goodput finding."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmesh.openai_stream import DONE_EVENT, sse_event
from kvmesh_cli.replay import replay
from kvmesh_cli.report import RequestResult, SweepPoint, goodput_rps, load_split, slo_crossed, slo_throughput
from kvmesh_cli.workloads import Segment, Workload, WorkloadRequest

ANSWER_S = 0.15


def scripted_router(seen: list[dict[str, object]]) -> httpx.MockTransport:
    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        seen.append(json.loads(request.content))
        await asyncio.sleep(ANSWER_S)
        usage = {"prompt_tokens": 3, "completion_tokens": 2}
        body = b"".join(sse_event(json.dumps({"choices": [{"text": t}], **extra}).encode())
                        for t, extra in (("a", {}), ("b", {}), ("", {"usage": usage})))
        return httpx.Response(200, content=body + DONE_EVENT, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(answer)


def req(i: int, session: str, after: int | None = None, think: float | None = None, arrival: float = 0.0):
    return WorkloadRequest(i, arrival, (Segment(f"{session}:{i}", 8),), 2, session, after, think)


async def test_closed_loop_waits_for_answer_plus_think_time() -> None:
    wl = Workload("w", [req(0, "s"), req(1, "s", 0, 0.3), req(2, "s", 1, 0.1)], 0)
    out = await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router([]))
    r = {x.index: x for x in out.results}
    assert all(x.ok for x in r.values())
    for prev, nxt, think in ((0, 1, 0.3), (1, 2, 0.1)):
        gap = r[nxt].sent_at - (r[prev].sent_at + r[prev].e2e_s)  # type: ignore[operator]
        assert think - 0.01 <= gap <= think + 0.15
    # time_scale: think times are model seconds
    out2 = await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router([]), time_scale=3.0)
    r2 = {x.index: x for x in out2.results}
    gap = r2[1].sent_at - (r2[0].sent_at + r2[0].e2e_s)  # type: ignore[operator]
    assert gap < 0.3 - 0.1 + 0.02


async def test_session_cap_holds_a_session_until_one_ends() -> None:
    wl = Workload("w", [req(0, "a"), req(1, "b"), req(2, "a", 0, 0.05), req(3, "b", 1, 0.05)], 0)
    out = await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router([]), max_sessions=1)
    r = {x.index: x for x in out.results}
    a_done = r[2].sent_at + r[2].e2e_s  # type: ignore[operator]
    assert r[1].sent_at >= a_done - 0.005  # session b starts only when a finished
    free = await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router([]))
    f = {x.index: x for x in free.results}
    assert f[1].sent_at - f[0].sent_at < ANSWER_S  # without the cap both start at once


async def test_text_prompt_format_sends_text() -> None:
    seen: list[dict[str, object]] = []
    wl = Workload("w", [req(0, "a")], 0)
    await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router(seen), prompt_format="text")
    await replay(wl, router_url="http://r", engine_urls=[], transport=scripted_router(seen))
    assert isinstance(seen[0]["prompt"], str) and seen[1]["prompt"][0] == 1  # type: ignore[index]
    with pytest.raises(ValueError):
        await replay(wl, router_url="http://r", engine_urls=[], prompt_format="xml")


def test_goodput_finds_the_slo_crossing() -> None:
    pts = [SweepPoint(1, 1.0, 0.5), SweepPoint(2, 2.0, 1.5), SweepPoint(4, 3.0, 3.5), SweepPoint(8, 3.2, 9.0)]
    # crosses 2.0 between 2.0 req/s (1.5 s) and 3.0 req/s (3.5 s): a quarter of the way
    assert slo_throughput(pts, 2.0) == pytest.approx(2.25)
    assert slo_throughput(pts, 10.0) == pytest.approx(3.2)  # never crosses: the heaviest point
    assert slo_throughput(pts, 0.1) is None  # even the lightest misses
    assert slo_throughput(list(reversed(pts)), 2.0) == pytest.approx(2.25)  # order of points does not matter
    assert slo_crossed(pts, 2.0) and not slo_crossed(pts, 10.0)


def test_goodput_per_run_and_load_split() -> None:
    results = [RequestResult(0, True, ttft_s=0.5), RequestResult(1, True, ttft_s=3.0), RequestResult(2, False)]
    assert goodput_rps(results, 2.0, 10.0) == pytest.approx(0.1)
    assert goodput_rps(results, 2.0, 10.0, time_scale=10.0) == 0.0  # TTFTs are 5 and 30 model seconds
    before = {"a": (0.0, 0.0, 0.0), "b": (10.0, 20.0, 1.0)}
    after = {"a": (50.0, 150.0, 3.0), "b": (10.0, 70.0, 2.0)}
    reqs, prefill, imbalance = load_split(before, after, ["a", "b", "c"])
    assert reqs == [3, 1, 0] and prefill == [100.0, 50.0, 0.0] and imbalance == pytest.approx(2.0)
