"""Pinned decisions: the same inputs give the same picks, fallbacks, totals and breakdowns.

The hot-path work of issue 10 (flat score columns, a lazy breakdown, cached metric children, the
early-stopping prefix walk) must not change a single decision. These scenarios were recorded with
the code before that work (2026-11-30): 40 endpoints with seeded load (ties included, so the
picker's random tie-break is exercised), seeded prefix matches, the named configs through
``Scheduler.pick``; each pick's ranked ids, weighted totals and per-scorer scores are digested.
A change of any decision, tie order, total or breakdown value changes the digest.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import pytest

from kvmesh.types import Endpoint, EndpointId
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import PluginHandle, PrefixMatch, SchedulingRequest
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter, LiveEndpointFilterParams
from services.epp.scheduler import Scheduler

MODEL = "m"
BLOCK = 16


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


class _GivenMatch:
    def __init__(self) -> None:
        self.next = PrefixMatch(0, {})

    async def score(self, model: str, token_ids: Sequence[int], endpoint_ids: Sequence[str]) -> PrefixMatch:
        return self.next


async def _decisions(config: str, picks: int = 60) -> tuple[list[str], str]:
    rnd = random.Random(42)
    clock = _Clock()
    datastore = Datastore(clock=clock)  # type: ignore[arg-type]
    eps = {}
    for i in range(40):
        eid = EndpointId(f"10.0.0.{i}:8000")
        eps[eid] = Endpoint(id=eid, url=f"http://10.0.0.{i}:8000", model=MODEL, block_size_tokens=BLOCK)
    datastore.apply_membership(eps, {})
    given = _GivenMatch()
    source, data = resolve_scheduling_config(config)
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=given),
                            source=source)
    scheduler = Scheduler(datastore, profile, LiveEndpointFilter("live-endpoints", LiveEndpointFilterParams()))
    ids = sorted(eps)
    targets: list[str] = []
    digest = hashlib.sha256()
    for r in range(picks):
        if r % 10 == 0:
            clock.t += 0.5
            for eid in ids:
                datastore.record_scrape(eid, ScrapeSample(
                    num_requests_waiting=rnd.randint(0, 2), num_requests_running=rnd.randint(0, 3),
                    kv_cache_usage_perc=rnd.choice((0.0, 0.25, 0.5, rnd.random())), block_size_tokens=BLOCK,
                    num_requests_finished=float(r), num_first_tokens=float(r) if r % 20 else None,
                ))
        tokens = tuple(rnd.randrange(1000) for _ in range(rnd.choice((0, 5, 40, 200))))
        total = len(tokens) // BLOCK
        matched = {str(e): rnd.randint(0, total) for e in rnd.sample(ids, rnd.randint(0, 12))} if total else {}
        given.next = PrefixMatch(total, {e: n for e, n in matched.items() if n})
        excluded = frozenset(str(e) for e in rnd.sample(ids, rnd.choice((0, 0, 1, 3))))
        decision = await scheduler.pick(SchedulingRequest(
            model=MODEL, request_id=f"r{r}", token_ids=tokens, exclude_endpoint_ids=excluded))
        targets.append(str(decision.target.id))
        assert [e.id for e in decision.fallbacks] == [s.id for s in decision.breakdown[1:]]
        digest.update(repr([(str(s.id), s.total, sorted(s.scores.items())) for s in decision.breakdown]).encode())
        clock.t += 0.001
    return targets, digest.hexdigest()


PINNED: dict[str, tuple[list[str], str]] = {
    # llm-d's blend: `precise-prefix` as recorded before issue 9's sticky-session margin (same digest).
    "llm-d-blend": (
        ['10.0.0.12:8000', '10.0.0.34:8000', '10.0.0.10:8000', '10.0.0.12:8000', '10.0.0.5:8000', '10.0.0.24:8000', '10.0.0.17:8000', '10.0.0.8:8000'],
        "d2091de58ec7d9b28f0251053b51e1f3e1b490d252da1017d8e2fb24b7639665",
    ),
    # Re-pinned 2026-11-30 (issue 9, wave 6): the config gained `session-affinity-scorer` (weight 10), so
    # every breakdown has one more column; recorded with the code whose blend pin is unchanged above.
    "precise-prefix": (
        ['10.0.0.12:8000', '10.0.0.34:8000', '10.0.0.10:8000', '10.0.0.12:8000', '10.0.0.5:8000', '10.0.0.24:8000', '10.0.0.17:8000', '10.0.0.8:8000'],
        "9f4690f5381fcdb134048d9d00ffa91b1a8dd8c0f7f9d977af2e965f4ba5fa28",
    ),
    "prefill-cost": (
        ['10.0.0.27:8000', '10.0.0.33:8000', '10.0.0.22:8000', '10.0.0.18:8000', '10.0.0.16:8000', '10.0.0.38:8000', '10.0.0.17:8000', '10.0.0.36:8000'],
        "4c9556773cdf490422d167dc27d576008fa4a601158bdb50fa67a4be2fdfbf04",
    ),
    "load-only": (
        ['10.0.0.12:8000', '10.0.0.12:8000', '10.0.0.10:8000', '10.0.0.8:8000', '10.0.0.21:8000', '10.0.0.23:8000', '10.0.0.10:8000', '10.0.0.4:8000'],
        "69aa1abb4c51fc6f3ac18100d461d5ae8623207378b63b93f8941db8ade0bdbf",
    ),
    "round-robin": (
        ['10.0.0.0:8000', '10.0.0.10:8000', '10.0.0.11:8000', '10.0.0.12:8000', '10.0.0.13:8000', '10.0.0.14:8000', '10.0.0.15:8000', '10.0.0.16:8000'],
        "a2e94fb534be9a519cb172304ee187e9715da6d8a2595f694547a4842247651f",
    ),
}
"""Per config: the first eight targets (readable) and the digest of all 60 decisions."""


@pytest.mark.parametrize("config", sorted(PINNED))
async def test_decisions_are_pinned(config: str) -> None:
    targets, digest = await _decisions(config)
    want_targets, want_digest = PINNED[config]
    assert targets[:8] == want_targets
    assert digest == want_digest, f"{config}: a decision, tie order, total or breakdown changed"
