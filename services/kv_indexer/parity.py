"""The parity handshake: what an engine registered (block size, hash algorithm) against what it sends.

kvmesh keys blocks by their token ids at the registered block size, so two things must hold for a
model's scores to mean anything: the engines' events use the block size they registered, and
their block hashes cover nothing but the tokens (no seed, LoRA, salt or multimodal key that kvmesh
would not see). :class:`ParityMonitor` checks both per endpoint as events arrive:

* ``block_size``: every ``BlockStored.block_size`` against ``Endpoint.block_size_tokens``;
* ``hash_algo``: for an endpoint registered with a hash algorithm the index can compute
  (``sha256_cbor``, vLLM 0.32's ``--prefix-caching-hash-algo sha256_cbor``; the formula is
  :func:`kvmesh.hashing.sha256_cbor_block_hashes`), the first block of a prompt (``parent`` None,
  no extra keys) is re-hashed, on the first such event and then every ``sample_every``-th;
  an endpoint registered with another or no algorithm is counted ``unverifiable``.

A mismatch puts the endpoint's model in *load-only* mode (Score answers ``LOAD_ONLY`` with no
scores, so the picker routes on load alone) and raises ``kvmesh_kv_indexer_parity_mismatch``,
until that endpoint leaves or registers again. Pure: no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes
from kvmesh.kv_events import BlockStored
from kvmesh.types import Endpoint, EndpointId
from services.kv_indexer import metrics

logger = logging.getLogger(__name__)


@dataclass
class _Checked:
    endpoint: Endpoint
    roots_seen: int = 0
    mismatch: str = ""


@dataclass
class ParityMonitor:
    """Per endpoint parity state; ``load_only(model)`` is what Score consults.

    Args:
        sample_every: re-hash one prompt-starting ``BlockStored`` in this many (the first always).
    """

    sample_every: int = 64
    _endpoints: dict[EndpointId, _Checked] = field(default_factory=dict)

    def register(self, endpoint: Endpoint) -> None:
        """(Re)start checking ``endpoint`` (a new registration clears its mismatch)."""
        previous = self._endpoints.get(endpoint.id)
        if previous is not None and previous.endpoint == endpoint:
            return
        self.forget(endpoint.id)
        self._endpoints[endpoint.id] = _Checked(endpoint)

    def forget(self, endpoint_id: EndpointId) -> None:
        checked = self._endpoints.pop(endpoint_id, None)
        if checked is not None and checked.mismatch:
            self._publish(checked.endpoint.model)

    def check(self, endpoint_id: EndpointId, event: BlockStored) -> None:
        checked = self._endpoints.get(endpoint_id)
        if checked is None or checked.mismatch:
            return
        endpoint = checked.endpoint
        if not event.token_ids:  # an offload connector's medium-only store: vLLM 0.32's default form says
            return  # block_size 0 (offloading/events.py, _placeholder_stored); nothing to hash or compare
        if event.block_size != endpoint.block_size_tokens:
            self._mismatch(checked, "block_size", f"registered {endpoint.block_size_tokens}, events say {event.block_size}")
            return
        if event.parent_block_hash is not None or not event.block_hashes:
            return  # not a prompt's first block
        checked.roots_seen += 1
        if (checked.roots_seen - 1) % self.sample_every:
            return
        if endpoint.hash_algo != "sha256_cbor":
            metrics.record_parity_check("unverifiable")
            return
        if event.extra_keys and any(k is not None for k in event.extra_keys):
            metrics.record_parity_check("skipped_extra_keys")
            return
        size = event.block_size
        expected = sha256_cbor_block_hashes(event.token_ids[:size], size)
        if len(expected) != 1 or external_hash_to_int(expected[0]) != external_hash_to_int(event.block_hashes[0]):
            self._mismatch(checked, "hash_algo", f"block hash is not {endpoint.hash_algo} of its tokens")
            return
        metrics.record_parity_check("ok")

    def load_only(self, model: str) -> bool:
        return any(c.mismatch and c.endpoint.model == model for c in self._endpoints.values())

    def mismatches(self) -> dict[EndpointId, str]:
        return {eid: c.mismatch for eid, c in self._endpoints.items() if c.mismatch}

    def _mismatch(self, checked: _Checked, reason: str, detail: str) -> None:
        checked.mismatch = reason
        metrics.record_parity_check(f"mismatch_{reason}")
        logger.error(
            "PARITY MISMATCH endpoint=%s model=%s reason=%s (%s): model %s is routed on load only until it re-registers",
            checked.endpoint.id, checked.endpoint.model, reason, detail, checked.endpoint.model,
        )
        self._publish(checked.endpoint.model)

    def _publish(self, model: str) -> None:
        reasons = {c.mismatch for c in self._endpoints.values() if c.mismatch and c.endpoint.model == model}
        for reason in ("block_size", "hash_algo"):
            metrics.set_parity_mismatch(model, reason, reason in reasons)
