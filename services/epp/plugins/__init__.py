"""Every shipped plugin, one file each (prepare steps, filters, scorers, pickers), and :func:`default_registry`."""

from __future__ import annotations

from services.epp.framework.registry import PluginRegistry
from services.epp.plugins.filters import live_endpoint
from services.epp.plugins.pickers import max_score, random_picker, round_robin
from services.epp.plugins.prepare import prefix_match
from services.epp.plugins.scorers import (
    kv_cache_utilization,
    precise_prefix_cache,
    prefill_cost,
    queue,
    routed_prefill,
    session_affinity,
    tier_cost,
)

_MODULES = (
    prefix_match, live_endpoint, queue, kv_cache_utilization, precise_prefix_cache, prefill_cost, tier_cost, max_score,
    random_picker, round_robin, session_affinity, routed_prefill,
)


def default_registry() -> PluginRegistry:
    """A fresh registry holding every shipped plugin type."""
    registry = PluginRegistry()
    for module in _MODULES:
        registry.register(module.TYPE, module.factory)
    return registry
