"""KvStoreConfig: every knob of the kv_store service (flags > env > file > defaults)."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig
from services.kv_store.tiers.files import FsyncPolicy, check_marker_name

MIB = 1024 * 1024


class KvStoreConfig(GrpcServiceConfig):
    """The tiered KV store: CPU first, then optional disk (NVMe), shared filesystem and Mooncake tiers."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_KV_STORE_")

    cpu_capacity_bytes: int = Field(1024 * MIB, gt=0)
    """Budget of the in-memory tier for value bytes; least recently used keys are evicted beyond it."""
    get_chunk_bytes: int = Field(2 * MIB, ge=1024, le=3 * MIB)
    """Size of each data chunk a Get streams back (below gRPC's default 4 MiB message limit)."""
    max_inflight_put_bytes: int = Field(1024 * MIB, gt=0)
    """Cap on value bytes buffered by puts in flight, gRPC ``Put`` and ``lm://`` ``PUT`` together, charged
    as the bytes arrive; a chunk that does not fit waits, first come first served (flow control)."""
    put_budget_wait_s: float = Field(30.0, gt=0)
    """Longest wait of a put's chunk for room in ``max_inflight_put_bytes``; then gRPC answers
    ``RESOURCE_EXHAUSTED`` and ``lm://`` discards the rest of that PUT (counted ``reason="busy"``)."""
    put_idle_timeout_s: float = Field(60.0, gt=0)
    """A gRPC Put whose client sends no message for this long ends with ``INVALID_ARGUMENT`` and frees
    what it held; an ``lm://`` PUT payload that stalls this long closes its connection."""

    disk_path: str = ""
    """Local NVMe tier: parent directory; the tier lives in ``<disk_path>/<instance_id or 'default'>``, both
    created at start when missing (the parent of ``disk_path`` must exist) and write-probed: a path that is
    a file or read-only stops kv_store (exit 2). Empty: no disk tier."""
    disk_capacity_bytes: int = Field(16 * 1024 * MIB, gt=0)
    """Budget of the disk tier for value bytes (LRU eviction beyond it)."""
    disk_fsync: FsyncPolicy = FsyncPolicy.NONE
    """``none`` (a cache: checksums catch torn files), ``data`` (fsync each value), ``all`` (and its directory)."""
    shared_path: str = ""
    """Shared filesystem tier (Lustre-style): a directory every instance mounts; never created. A file
    there: kv_store exits 2; missing, read-only (a write probe) or failing a guard below at start: an
    ERROR line and a degraded start, the tier used once the path works. Empty: none."""
    shared_require_mount: bool = False
    """Use the shared tier only while ``shared_path`` is a mount point (``os.path.ismount``: its device
    differs from its parent's), so an unmounted filesystem's empty mount point is never written to.
    For a ``shared_path`` that is the mount itself; a subdirectory of the mount or a bind mount needs
    ``shared_marker``. Off by default (a plain directory works); re-checked every second at run time."""
    shared_marker: str = ""
    """A file name that must exist in ``shared_path`` (e.g. ``.kvmesh-shared``), created once by the
    operator on the mounted shared filesystem (``touch /mnt/lustre/kvmesh/.kvmesh-shared``); while it is
    missing the tier is unavailable (not mounted). kvmesh never creates it. Empty: no marker."""
    shared_capacity_bytes: int = Field(64 * 1024 * MIB, gt=0)
    """This instance's budget in the shared namespace (soft across instances; use an FS quota for a hard one)."""
    shared_fsync: FsyncPolicy = FsyncPolicy.NONE
    """fsync policy of the shared tier."""

    @field_validator("shared_marker")
    @classmethod
    def _plain_marker(cls, marker: str) -> str:
        check_marker_name(marker)
        return marker
    mooncake_master: str = ""
    """``host:port`` of a ``mooncake_master``; empty: no Mooncake tier. The client binds 0.0.0.0 (see docs)."""
    mooncake_metadata: str = "P2PHANDSHAKE"
    """Mooncake metadata server URL (``http://host:port/metadata``) or ``P2PHANDSHAKE``."""
    mooncake_local_hostname: str = "127.0.0.1"
    """Address this instance's Mooncake segment is advertised under."""
    mooncake_segment_bytes: int = Field(512 * MIB, gt=0)
    """Memory this instance contributes to the Mooncake cluster (its global segment)."""
    mooncake_buffer_bytes: int = Field(64 * MIB, gt=0)
    """Mooncake client's local transfer buffer."""
    mooncake_capacity_bytes: int = Field(4 * 1024 * MIB, gt=0)
    """This instance's budget of value bytes in the Mooncake cluster."""
    mooncake_namespace: str = "kvmesh/"
    """Key prefix in Mooncake; instances with the same namespace share values."""
    mooncake_master_http: str = ""
    """``host:port`` of the master's HTTP port (``mooncake_master -metrics_port``), whose
    ``/get_all_keys`` lists the cluster's keys: at start-up the Mooncake tier's values in the
    namespace are adopted and republished as KV events. Empty: no rescan (values are still served)."""
    write_through: list[str] = Field(default_factory=list)
    """Slower tiers (``disk``, ``sharedfs``, ``mooncake``) that receive every put synchronously."""
    promote_on_hit: bool = True
    """Copy a value found in a slower tier into the first (CPU) tier."""
    tier_timeout_s: float = Field(10.0, gt=0)
    """Longest wait for one operation of a tier below CPU (disk, shared filesystem, Mooncake: a put,
    get, contains, evict or release). On expiry the tier counts as unavailable (the degraded path: a
    demotion goes on to the next tier or is lost, a write-through is dropped, a read misses;
    ``kvmesh_kv_store_tier_timeouts_total``) and stays so while the operation runs (a hung mount):
    a put whose victims must move through it returns. The operation runs to its end; what it did
    is settled then."""
    lmcache_port: int | None = Field(None, ge=0, le=65535)
    """LMCache's ``lm://`` remote-server protocol (lmcache 0.5.6) on ``host:lmcache_port``, served from
    the same tiers (services/kv_store/lmcache_server.py). None: off; 0: a free port, reported as
    ``"lmcache"`` in the ports file. LMCache's own server's usual port is 65432."""
    lmcache_max_connections: int = Field(1024, gt=0)
    """Open ``lm://`` connections at most (LMCache opens one per engine worker); a connection beyond it
    is accepted and closed at once, counted ``kvmesh_kv_store_lmcache_protocol_errors_total{reason="too_many_connections"}``."""

    events_endpoint: str = ""
    """KV events for kv_indexer (vLLM 0.32 wire): ZMQ PUB endpoint, ``tcp://host:port`` of kv_indexer's
    bound SUB (``--events-bind-endpoint``). Empty: residency is not published."""
    events_replay_endpoint: str = "tcp://127.0.0.1:*"
    """ROUTER endpoint of the replay buffer (vLLM's ``replay_endpoint``), registered so kv_indexer can
    recover gaps; ``*`` picks a free port. Empty: no replay."""
    events_model: str = ""
    """The model whose blocks this instance publishes (one per instance, like an InferencePool's cache);
    required with ``events_endpoint``."""
    events_block_size_tokens: int = Field(64, gt=0)
    """Block size of the published blocks (the engines'); a put whose ``block_stored_event`` has another
    block size is refused (INVALID_ARGUMENT)."""
    events_buffer_steps: int = Field(10_000, gt=0)
    """Batches kept for replay (vLLM's ``buffer_steps``)."""
    shared_domains: list[str] = Field(default_factory=list)
    """Names of the shared namespaces this instance's shared tiers belong to (label ``shared_domains``).
    Empty: derived, ``sharedfs:<realpath of shared_path>`` and ``mooncake:<master>/<namespace>``; set it
    when instances mount one filesystem under different paths."""
