"""A fixed set of observations per service, rendered as that service's ``/metrics`` text.

Each scenario builds the service's metrics (its ``metrics.py``, without starting the process),
records the same observations every time and returns ``generate_latest`` of the registry the
process serves. :func:`normalise` removes what varies between runs: ``*_created`` timestamps and
the process/platform/GC collectors of the default registry.

Services whose metrics live in the default registry (router, epp, kv_indexer,
registration_sidecar) must be rendered in a fresh interpreter, since other tests record into the
same module-level metrics: ``python -m tests.contract.metrics_scenarios <service>`` prints the
normalised text, and ``tests/contract/test_metrics_exposition.py`` runs it once per service.
"""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

VARYING_FAMILIES = re.compile(r"^(process_|python_gc_|python_info\b)")
"""Default-registry collectors whose values depend on the machine and the interpreter."""


def normalise(text: str) -> str:
    """Drop ``*_created`` series and the process/platform/GC families; keep everything else in order."""
    kept = []
    for line in text.splitlines():
        name = line.split()[2] if line.startswith("# ") else re.split(r"[{ ]", line, maxsplit=1)[0]
        if name.endswith("_created") or VARYING_FAMILIES.match(name):
            continue
        kept.append(line)
    return "\n".join(kept) + "\n"


def etcd(registry: CollectorRegistry = REGISTRY) -> None:
    """The shared etcd families every etcd-using process serves (``kvmesh.membership``): one client
    failed a watch, then reached etcd again. On the default registry they are there from import."""
    from kvmesh import membership

    if registry is not REGISTRY:
        membership.register_etcd_metrics(registry)
    client = object()
    membership.ETCD_STATE.failed(client, "watch", "scenario")
    membership.ETCD_STATE.succeeded(client)


def router() -> bytes:
    from services.router import metrics

    metrics.record_outcome(metrics.outcome_for_status(200))
    metrics.record_outcome(metrics.outcome_for_status(200))
    metrics.record_outcome(metrics.outcome_for_status(429))
    metrics.record_outcome(metrics.outcome_for_status(502))
    metrics.record_ttft("tiny", 0.05)
    metrics.record_ttft("", 0.3)
    metrics.record_e2e("tiny", 1.5)
    metrics.record_retry()
    metrics.record_stage("pick", 0.0004)
    metrics.record_engine_stalled("first_byte_timeout", "redispatched")
    metrics.record_engine_stalled("first_byte_timeout", "abandoned")
    metrics.IN_FLIGHT.inc()
    etcd()
    return generate_latest(REGISTRY)


def epp() -> bytes:
    from services.epp import metrics
    from services.epp.framework.interfaces import ExtensionPoint

    metrics.record_pick(metrics.PickOutcome.PICKED, 0.0004)
    metrics.record_pick(metrics.PickOutcome.NO_ENDPOINTS, 0.00002)
    metrics.record_plugin(ExtensionPoint.FILTER, "live-endpoint", 0.00001)
    metrics.record_plugin(ExtensionPoint.PREPARE, "prefix-match", 0.002)
    metrics.record_plugin(ExtensionPoint.SCORER, "queue-scorer", 0.00003)
    metrics.record_plugin(ExtensionPoint.PICKER, "max-score-picker", 0.00001)
    metrics.record_scrape("ok")
    metrics.record_scrape("error")
    metrics.record_prefix_index_score(metrics.PrefixIndexPath.REPLICA)
    metrics.record_prefix_index_score(metrics.PrefixIndexPath.REPLICA)
    metrics.record_prefix_index_score(metrics.PrefixIndexPath.RPC_FALLBACK)
    etcd()
    return generate_latest(REGISTRY)


def kv_indexer() -> bytes:
    from services.kv_indexer import metrics

    metrics.record_event("BlockStored", "applied")
    metrics.record_event("BlockRemoved", "applied")
    metrics.record_event("BlockStored", "orphaned")
    metrics.record_batch_dropped("bad_msgpack")
    metrics.record_batch_dropped("")
    metrics.record_sequence_gap(3)
    metrics.record_score(0.0002, {"GPU": 4, "CPU": 1, "DISK": 0})
    metrics.track_index_size(lambda: 7, lambda: 2)
    metrics.record_recovery("gap", "recovered", 0.02, 3)
    metrics.record_recovery("first_batch", "unreliable", 3.0, 0)
    metrics.record_loss("replay_incomplete", 6)
    metrics.record_tail_probe("found")
    metrics.record_incarnation("instance_id")
    metrics.record_parity_check("ok")
    metrics.set_parity_mismatch("tiny", "hash_algo", True)
    metrics.set_ready(True)
    metrics.record_snapshot("save", 0.004)
    metrics.track_states(lambda: {"live": 2, "unreliable": 1}, lambda: 5.0)
    etcd()
    return generate_latest(REGISTRY)


def kv_store() -> bytes:
    from services.kv_store.metrics import register_metrics
    from services.kv_store.store import BlockStore
    from services.kv_store.tiers.cpu import CpuTier

    async def observe(store: BlockStore) -> None:
        await store.put("a", b"x" * 40)
        await store.put("b", b"y" * 40)
        await store.put("c", b"z" * 40)  # evicts "a"
        await store.get("b")
        await store.tiers[0].get("a")  # a miss

    ticks = iter(i * 0.0002 for i in range(1000))  # every operation takes 0.2 ms
    store = BlockStore([CpuTier(100)], clock=lambda: next(ticks))
    asyncio.run(observe(store))
    registry = CollectorRegistry()
    register_metrics(store, registry)
    from services.kv_store.lmcache_protocol import LmCommand
    from services.kv_store.lmcache_server import LmcacheStats, register_lmcache_metrics

    lm = LmcacheStats(bytes_received=1186, bytes_sent=1036, connections_open=1, connections_total=2)
    lm.count(LmCommand.PUT, "stored")
    lm.count(LmCommand.GET, "hit")
    lm.observe(LmCommand.PUT, 0.0002)
    lm.observe(LmCommand.GET, 0.0002)
    lm.protocol_error("bad_command")
    register_lmcache_metrics(lm, registry)
    etcd(registry)
    return generate_latest(registry)


def flow_control() -> bytes:
    from services.flow_control.metrics import PrometheusObserver
    from services.flow_control.types import AdmissionRequest, QueueOutcome

    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    request = AdmissionRequest(request_id="r1", model="tiny", prompt_tokens=10)
    observer.on_outcome(request, QueueOutcome.DISPATCHED, 0.0)
    observer.on_outcome(request, QueueOutcome.DISPATCHED, 0.2)
    observer.on_outcome(request, QueueOutcome.EVICTED_TTL, 30.0)
    observer.on_state(3, 2)
    etcd(registry)
    return generate_latest(registry)


def registration_sidecar() -> bytes:
    from services.registration_sidecar import metrics

    metrics.REGISTERED.set(1)
    metrics.HEALTH_CHECKS.labels("ok").inc(3)
    metrics.HEALTH_CHECKS.labels("failed").inc()
    metrics.TRANSITIONS.labels("register").inc()
    etcd()
    return generate_latest(REGISTRY)


def engine_simulator() -> bytes:
    from engine_simulator.app import cache_config_info
    from engine_simulator.config import SimulatorConfig
    from engine_simulator.metrics import EngineMetrics

    config = SimulatorConfig.model_validate(
        {"model": "tiny", "block_size_tokens": 32, "num_gpu_blocks": 16384, "max_model_len": 512}
    )
    metrics = EngineMetrics("tiny", cache_config_info(config), 512)
    metrics.record_scheduled(prompt_tokens=100, cached_tokens=64)
    metrics.record_step(running=1, waiting=2, usage=0.25, step_tokens=100, new_preemptions=1, new_generation_tokens=1)
    metrics.record_first_token(ttft_seconds=0.05)
    metrics.record_token(itl_seconds=0.02)
    metrics.record_finished(
        finish_reason="length",
        prompt_tokens=100,
        cached_tokens=64,
        generation_tokens=4,
        e2e_seconds=0.4,
        queue_seconds=0.01,
        prefill_seconds=0.05,
        decode_seconds=0.3,
    )
    return metrics.exposition()


SCENARIOS: dict[str, Callable[[], bytes]] = {
    "router": router,
    "epp": epp,
    "kv_indexer": kv_indexer,
    "kv_store": kv_store,
    "flow_control": flow_control,
    "registration_sidecar": registration_sidecar,
    "engine_simulator": engine_simulator,
}


def render(service: str) -> str:
    """The normalised exposition of ``service`` after its scenario (call in a fresh interpreter)."""
    return normalise(SCENARIOS[service]().decode())


if __name__ == "__main__":
    sys.stdout.write(render(sys.argv[1]))
