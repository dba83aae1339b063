"""kv_indexer configuration: flags ``--events-bind-endpoint ...``, env ``KVMESH_KV_INDEXER_*``, or a YAML file."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig


class KvIndexerConfig(GrpcServiceConfig):
    """kv_indexer: the global KV-block index, fed by the engines' ZMQ KV events."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_KV_INDEXER_")

    events_bind_endpoint: str = "tcp://127.0.0.1:5557"
    """ZMQ endpoint the KV-event SUB socket binds (engines with a plain tcp://host:port connect to it); "" binds nothing."""
    event_workers: int = Field(4, ge=1, le=64)
    """Event pool shards; one endpoint's events always go to the same one, in order."""
    event_queue_size_messages: int = Field(10000, ge=1, le=10_000_000)
    """Messages each event worker may queue before new ones are dropped (counted as queue_full)."""
    zmq_rcvhwm_messages: int = Field(100000, ge=0)
    """ZMQ receive high-water mark of the SUB socket (0: unlimited)."""
    pending_batches_per_endpoint: int = Field(256, ge=0, le=100000)
    """Messages held for an endpoint not yet seen in etcd, applied when it joins (0: drop them); also
    the most held for a registered endpoint while a registration is awaited: a departed endpoint's
    restarted publisher (the oldest dropped beyond), or a sequence reset (followed at once beyond)."""
    pending_ttl_seconds: float = Field(10.0, gt=0, le=3600)
    """How long such held messages stay applicable; also how long the new stream of an endpoint
    registered with an instance_id whose sequence reset waits for its new registration (a
    crash-restart within the lease TTL) before it is followed as a restart."""
    recent_removed_blocks: int = Field(4096, ge=0, le=10_000_000)
    """Per endpoint, removed block hashes remembered to place later chains whose parent was evicted."""
    orphan_blocks: int = Field(65536, ge=0, le=10_000_000)
    """Per endpoint, blocks kept by engine hash while their parent's key is unknown (oldest forgotten beyond)."""
    prompt_key_cache_mib: int = Field(64, ge=0, le=65536)
    """MiB of recently scored prompts' block keys kept, so a prompt extending one hashes only its new blocks (0: off)."""
    replay_timeout_seconds: float = Field(5.0, gt=0, le=600)
    """Deadline of one replay request to a publisher's replay endpoint; past it the missing messages
    count as lost (the endpoint's older entries are forgotten, docs/kv-index.md)."""
    recovery_buffer_messages: int = Field(100_000, ge=1, le=10_000_000)
    """Live messages buffered per endpoint while its gap is replayed; the oldest dropped beyond it are
    asked of the publisher's replay buffer again, and count as lost only when it can no longer serve them."""
    tail_probe_quiet_seconds: float = Field(2.0, ge=0, le=3600)
    """An endpoint with a replay endpoint that has been quiet this long after its last message is
    asked once for what followed it (vLLM sends no heartbeat: a lost final message is otherwise never
    noticed); 0 disables the tail probe."""
    tail_probe_timeout_seconds: float = Field(2.0, gt=0, le=600)
    """Deadline of one tail probe (a failed probe changes nothing; it is retried after another quiet period)."""
    tail_probe_attempts: int = Field(3, ge=1, le=100)
    """Failed tail probes in a row before the endpoint waits ``tail_probe_idle_max_seconds`` for the next
    round (0 there: until its next message); a round is this many probes a quiet period apart."""
    tail_probe_max_per_second: float = Field(20.0, gt=0, le=10000)
    """Tail probes started per second over all endpoints, at most (reached: a probe that ends starts the
    next, endpoints round-robin). Idle endpoints are re-probed every ``tail_probe_idle_max_seconds``
    up to ``rate * idle_max`` of them (600 with the defaults), every ``N / rate`` seconds beyond."""
    tail_probe_concurrency: int = Field(4, ge=1, le=256)
    """Tail probes in flight at once, at most (each holds a worker thread while it waits)."""
    tail_probe_idle_max_seconds: float = Field(30.0, ge=0, le=86400)
    """A tail the probe confirmed is probed again while the endpoint stays idle, at doubling intervals
    from twice ``tail_probe_quiet_seconds`` up to this (a final message lost after the last probe);
    0: not again until the endpoint's next message."""
    departed_retention_seconds: float = Field(120.0, ge=0, le=86400)
    """A departed endpoint (lease gone) is not scored, but its entries are kept this long for a rejoin
    of the same incarnation (an etcd pause), and its stream still applied (messages that read as a
    publisher restart held for the rejoin, this long at most); then purged, and its late messages
    dropped for this long again."""
    snapshot_path: str = ""
    """Snapshot file for warm restarts (empty: no snapshots, every start is cold)."""
    snapshot_interval_seconds: float = Field(30.0, gt=0, le=86400)
    """Seconds between periodic snapshots (one is also written on SIGTERM)."""
    warmup_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    """Longest time health stays NOT_SERVING while startup recoveries run; then serving regardless."""
    watch_status_poll_seconds: float = Field(0.25, gt=0, le=60)
    """How often each ``Watch`` stream (epp's prefix replica) checks endpoint states and readiness
    when nothing woke it: the longest an event-stream state change (an endpoint recovering or live again,
    a model load-only) waits to reach the replicas. Residency and membership changes (join,
    departure, purge) wake it at once. Was 0.05 s: 20 wake-ups
    per second per stream were most of an idle kv_indexer's CPU (docs/BENCHMARKS.md §3, issue 10)."""
    watch_heartbeat_seconds: float = Field(1.0, gt=0, le=60)
    """An idle ``Watch`` stream sends a heartbeat this often; keep it under a third of epp's
    ``kv_indexer_watch_stale_seconds`` (3 s) so a replica survives two late ones on a busy host."""
