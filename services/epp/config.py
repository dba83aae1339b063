"""EppConfig: every epp setting, typed, bounded and documented (flags > env KVMESH_EPP_* > --config file > defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig


class EppConfig(GrpcServiceConfig):
    """The endpoint picker: filters, weighted scorers and a picker choose an endpoint per request."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_EPP_")

    scheduling_config: str = "load-only"
    """A named scheduling config (round-robin, load-only, precise-prefix, prefill-cost, dynamo-cost, tier-cost, llm-d-blend) or the path of a YAML/JSON file."""
    kv_indexer_address: str = ""
    """kv_indexer gRPC host:port, needed by the prefix-match step ("" = none)."""
    kv_indexer_timeout_seconds: float = Field(0.25, gt=0, le=30)
    """Deadline of one kv_indexer Score call; past it the prefix scores are 0 for that pick."""
    prefix_index_mode: Literal["replica", "rpc"] = "replica"
    """How the prefix-match step asks kv_indexer: ``replica`` keeps a local copy of its key residency fed
    by its Watch stream and scores in process (Score RPC only while the stream is down or stale);
    ``rpc`` calls Score on every pick (docs/kv-index.md, "epp's replica")."""
    kv_indexer_watch_stale_seconds: float = Field(3.0, gt=0, le=60)
    """A replica whose Watch stream sent nothing (not even its heartbeat, kv_indexer's
    ``watch_heartbeat_seconds``, 1 s) for this long is not used (the Score RPC serves meanwhile)."""
    metrics_scrape_interval_seconds: float = Field(0.1, gt=0, le=60)
    """How often each engine's /metrics is scraped while it is busy (requests running or waiting, or
    picked since the last scrape)."""
    metrics_idle_scrape_interval_seconds: float = Field(1.0, gt=0, le=60)
    """How often an idle engine (nothing running or waiting, no pick since the last scrape) is scraped;
    a pick for it wakes its scraper at once (no polling), so the next scrape comes within the busy
    cadence. Capped at half of ``max_metrics_age_seconds`` so idle engines stay candidates and a
    dead idle engine is noticed by its failing scrape within about this long (docs/BENCHMARKS.md §3)."""
    metrics_scrape_timeout_seconds: float = Field(0.5, gt=0, le=60)
    """Timeout of one /metrics scrape."""
    max_metrics_age_seconds: float = Field(2.0, gt=0, le=3600)
    """An endpoint whose last good scrape is older than this is not a candidate. The age counts only the
    time epp's own event loop could run (its stalls are measured and not held against the engines;
    services/epp/datastore.py, "Freshness net of epp's own lag")."""
    routed_half_life_seconds: float = Field(300.0, gt=0, le=86_400)
    """Half-life of each pick's uncached prompt tokens in an endpoint's routed prefill, which
    ``routed-prefill-scorer`` spreads new sessions by (services/epp/datastore.py, "Routed prefill")."""
    max_consecutive_scrape_failures: int = Field(3, ge=1, le=1000)
    """An endpoint whose scrape failed this many times in a row is not a candidate."""
    tokenize_timeout_seconds: float = Field(2.0, gt=0, le=60)
    """Deadline of one tokenization (all attempts); past it the pick is scored by load."""
    tokenize_max_prompt_chars: int = Field(262_144, ge=1, le=100_000_000)
    """Longer prompts (characters; chat: the messages' contents) are never sent to /tokenize: scored by load."""
    tokenize_max_concurrency_per_endpoint: int = Field(4, ge=1, le=1024)
    """Tokenize calls in flight per engine; past it a pick does not wait (scored by load)."""
    tokenize_max_attempts: int = Field(2, ge=1, le=16)
    """Engines asked at most per tokenization; only a refused connection moves on (never a timeout)."""
    tokenize_cache_entries: int = Field(4096, ge=0, le=10_000_000)
    """Prompts whose token ids are kept (LRU); 0 disables the cache."""
    engine_api_key: SecretStr | None = None
    """API key epp presents (``Authorization: Bearer``) on its own engine calls (the ``/tokenize``
    fallback) for every pool without an entry in ``engine_api_keys``: the router's ``engine_api_key``
    (vLLM ``--api-key``; ``docs/openai-compat.md``). Env ``KVMESH_EPP_ENGINE_API_KEY``."""
    engine_api_keys: dict[str, SecretStr] = Field(default_factory=dict)
    """Per-pool engine keys: served model name -> key; wins over ``engine_api_key`` (as the router's)."""
    tokenizer_paths: dict[str, str] = Field(default_factory=dict)
    """Model -> local tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``, chat template)
    for in-process tokenization; models not listed use their endpoints' ``tokenizer`` label, else the
    engine's /tokenize. CLI: ``--tokenizer-paths '{"tiny": "/models/tiny"}'``."""
    tokenize_in_process: bool = True
    """Tokenize with the model's own files in epp (the engine's /tokenize only as a fallback)."""
    tokenize_cache_max_tokens: int = Field(2_000_000, ge=0, le=1_000_000_000)
    """Token ids each model's incremental chat cache keeps (LRU by chat)."""
    random_seed: int | None = None
    """Seed of the pickers' tie-breaking random source (None: from the OS)."""
    ext_proc_port: int = Field(0, ge=0, le=65535)
    """Port of the Gateway API inference extension's endpoint-picker protocol (Envoy ext_proc gRPC,
    services/epp/ext_proc.py); 0 picks a free one (reported as "ext_proc" in the ports file). GIE's is 9002."""
    ext_proc_destination_endpoints: int = Field(1, ge=1, le=16)
    """Endpoints in x-gateway-destination-endpoint: the target, then fallbacks (1 for Envoy ORIGINAL_DST clusters)."""
    ext_proc_max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024, le=1024 * 1024 * 1024)
    """Largest request body epp collects from Envoy (bytes); a larger one is answered 413."""
    ext_proc_metadata_namespace: str = "envoy.lb"
    """Dynamic-metadata namespace of the picked endpoint (GIE's --destination-endpoint-hint-metadata-namespace)."""
    ext_proc_destination_header: str = "x-gateway-destination-endpoint"
    """Header (and metadata key) carrying the picked endpoint (GIE's --destination-endpoint-hint-key)."""

    def engine_key_for(self, model: str) -> str | None:
        """The API key to present to the engines of ``model``'s pool, or None."""
        key = self.engine_api_keys.get(model) or self.engine_api_key
        return key.get_secret_value() if key is not None else None
