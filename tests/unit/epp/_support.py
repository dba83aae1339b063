"""Shared set-up of the tests that run epp's real scheduler (the router's picker tests use it too)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from kvmesh.clock import ManualClock
from kvmesh.types import Endpoint
from services.epp.datastore import Datastore, ScrapeSample
from services.epp.framework.interfaces import PluginHandle, PrefixIndex
from services.epp.framework.loader import build_profile, resolve_scheduling_config
from services.epp.plugins import default_registry
from services.epp.plugins.filters.live_endpoint import LiveEndpointFilter
from services.epp.scheduler import Scheduler

IDLE = ScrapeSample(0, 0, 0.0)
"""A scrape of an idle engine: nothing waiting or running, an empty KV cache."""


def real_scheduler(endpoints: Iterable[Endpoint], prefix_index: PrefixIndex, sample: ScrapeSample = IDLE,
                   config: str = "precise-prefix") -> tuple[Scheduler, Datastore]:
    """epp's scheduler with the built-in ``config`` profile (seeded rng, ``prefix_index`` as the kv_indexer)
    over ``endpoints``, each scraped once with ``sample`` (the datastore's clock stands still: the scrape
    stays fresh), and its datastore."""
    endpoints = list(endpoints)
    datastore = Datastore(ManualClock())
    source, data = resolve_scheduling_config(config)
    profile = build_profile(data, default_registry(), PluginHandle(rng=random.Random(0), prefix_index=prefix_index),
                            source)
    datastore.set_endpoints({e.id: e for e in endpoints})
    for e in endpoints:
        datastore.record_scrape(e.id, sample)
    return Scheduler(datastore, profile, LiveEndpointFilter("live")), datastore
