"""The KV store core: validation, placement and movement across an ordered list of tiers.

Tiers are ordered fastest first (``cpu``, ``disk``, then shared ones: ``sharedfs``, ``mooncake``).
Placement follows vLLM's OffloadingConnector and LMCache's storage manager (write to the fastest
medium, spill the least recently used downwards):

* ``put`` writes to the first tier. Values that tier evicts are **demoted** to the next tier (and
  so on down: a demotion that evicts there cascades); the last tier drops its victims. A demotion
  keeps the value reachable: the tier hands its victims out *pending* (still readable there, see
  :mod:`services.kv_store.tiers.base`) and the store releases each once a slower tier stored it,
  or once every slower tier refused it (then it is an eviction, counted lost). A put or delete
  of a key whose older value is moving down waits for that move to land, then replaces or sweeps
  it (no stale copy below, no deleted key back); a put also waits for the moves of its key begun
  after its value was stored (its own value evicted during the put, or an older copy a cascade
  evicted from a slower tier) and its sweep keeps the copies of its own value those moves landed;
  a move of the key begun during a sweep waits for it and lands only the swept value. These waits
  are bounded (:data:`SETTLE_TIMEOUT_S`); a move a write stopped waiting for is superseded (its
  copy removed where it lands, unless a newer move's put of the key into that tier is queued
  behind it), and a sweep that finds a move of the key putting into the tier
  it is about to clear waits for that put first (a move of the put's own value still lands).
  Every operation of a tier below the first is bounded too (:data:`TIER_TIMEOUT_S`): one that
  times out counts as the tier unavailable (the degraded path below), and the tier stays so
  while the operation runs (a hung medium); what it did is settled when it ends. A stale copy
  of the key in a slower tier is removed, unless ``write_through`` names that tier, which then receives the same value
  synchronously (a shared tier written through makes a value visible to every instance at once;
  its own victims are demoted below it, or evicted from the last tier, as any put's).
  A cascade cut short (cancelled, failed) leaves nothing pending: a tier that survives a restart
  (``reinstate``: file tiers, Mooncake) takes its unplaced victims back, any other releases them
  and counts them lost.
* ``get`` searches the tiers in order. A hit in a slower tier is **promoted** to the first tier
  (``promote_on_hit``); it leaves a private tier (local tiers are exclusive, so one copy per
  instance) and stays in a shared one (other instances read it too) or one written through. A
  promotion is a **swap**:
  the key is stored in the first tier first (readable there at once: a concurrent get of the same
  key, the usual case for a popular prefix block, never misses it), then its private slower copy
  is removed, then the first tier's victims are demoted into the room that leaves (a full disk,
  by its budget or by ENOSPC, still takes them). A promotion loses no value to a failed
  demotion: when a victim of its cascade finds no tier, the promotion is undone (the key returns
  to the tier it left, then leaves the first tier, then the victim returns there;
  ``promotions_undone``). The last tier's own LRU eviction still applies (a victim demoted into a
  full last tier evicts that tier's least recently used value, as any demotion does). A promotion
  never overwrites a newer value: a put or delete of the key in flight when the read began, or
  begun before the promotion's first-tier write, drops it; one begun after that write is ordered
  after it on the first tier and removes the slower copies itself (``promotions_superseded``
  counts both). A promotion of a victim pending on its way down removes that pending copy; the
  copy its move then lands is removed too when it lands in a private tier (one copy per instance),
  and stays when it lands in a shared or written-through tier (the block is then on both media).
  A put whose first-tier write fails stored nothing and takes its count back (a
  promotion that checks before the failure steps aside having removed nothing; one that checks
  after goes on). A get that missed everywhere while another get promoted its key looks
  again (:data:`MISS_RESCANS`).
* ``contains`` (and ``media``) is true when any tier holds the key, and looks again (as ``get``,
  :data:`MISS_RESCANS`) for the keys it missed while a promotion moved keys up past its scan, so a
  key being moved is never reported absent; ``delete`` drops it everywhere.
* **Restart.** Tiers that survive a restart (disk, shared FS) keep each value's description (the
  engine's ``BlockStored``) with it and rescan at start; the store adopts what they found at
  construction and publishes it as ``BlockStored`` on the tier's medium (in batches of
  :data:`REPUBLISH_BATCH` events), so routing knows the blocks again (a restarted instance is a
  new incarnation to kv_indexer, which dropped what the old one published).

A tier that fails (:class:`TierUnavailable`, :class:`StorageFull`: a missing or read-only shared
path, a full disk, Mooncake down) is a **degraded mode**: a get or contains there counts as a
miss, a write-through there is dropped (``dropped``), the error is counted (``failures``) and
logged at ERROR (at most one line per tier every :data:`ERROR_LOG_INTERVAL_S`, with the count of
lines suppressed); only a failure of the first tier on ``put`` reaches the caller. A demotion the
next tier cannot take goes to the tier after it, and so on down; a value no slower tier takes is
**lost** (``lost``, by the tier that evicted it, and :attr:`PutOutcome.lost`). Why a tier did not
take a demotion or a write-through is ``dropped``'s reason (:data:`DROP_REASONS`): ``unavailable``
and ``full`` are failures (counted in ``failures`` too, logged at ERROR); ``too_large`` (the
value exceeds that tier's whole capacity: a sizing choice, nothing failed) is counted only as
dropped and logged at DEBUG. Corrupt values are misses inside the tiers. Nothing is ever served
from a tier that failed.

Per-call figures (:class:`PutOutcome`'s ``evicted`` and ``lost``) are counted along the call's own
placement and cascade and returned up it, never read off the shared counters (a concurrent put's
losses are not this put's).

Per tier the store measures ``StoreMetrics``: latency of each verb (a fixed-bucket histogram,
seconds) and bytes moved into it by reason (``put``, ``demote``, ``promote``, ``write_through``).

Keys are non-empty strings of at most :data:`MAX_KEY_BYTES` UTF-8 bytes; every call refuses
any other key alike (:func:`validate_key`, :func:`validate_keys`). No grpc here: the
servicer assembles chunk streams into ``bytes`` and maps the domain errors raised below. With
only the CPU tier no operation suspends.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmesh.errors import InvalidRequest
from kvmesh.kv_events import BlockStored, KVEvent
from kvmesh.logging import RateLimitedLog
from kvmesh.types import Medium
from services.kv_store.errors import KeyNotFound, StorageFull, TierUnavailable, ValueTooLarge
from services.kv_store.residency import BadBlockEvent, Residency, parse_block_event
from services.kv_store.tiers.base import PutResult, ReleaseFailed, StoreTier, TierStats

MAX_KEY_BYTES = 4096
MAX_CONTAINS_KEYS = 100_000
LATENCY_BUCKETS_S = (
    0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0,
)  # fmt: skip
"""Histogram bounds in seconds: 10 µs (a CPU hit) to 3 s (a large value on a slow shared FS)."""
MOVE_REASONS = ("put", "demote", "promote", "write_through", "restore")
DROP_REASONS = ("unavailable", "full", "too_large")
"""Why a tier did not take a demotion or write-through: :class:`TierUnavailable`,
:class:`StorageFull` (both degraded modes), :class:`ValueTooLarge` (the value exceeds the tier's
capacity: not a failure)."""
MISS_RESCANS = 2
"""Extra passes of a get that missed in every tier while a concurrent get promoted its key (and of
a contains or lookup over the keys it missed while any promotion ran)."""
REPUBLISH_BATCH = 1024
"""Events per batch when republishing rescanned values (a 16 GiB disk tier of 2 MiB values: 8 batches)."""

SETTLE_TIMEOUT_S = 30.0
"""Longest wait of a put or delete for the moves down of its key in flight (a hung tier under the
move: a file write on a stalled mount, a Mooncake transfer). On expiry the write goes on (counted in
``settle_timeouts``, logged at WARNING) and the moves it stopped waiting for are *superseded*: a
copy they land later is removed where it lands, so no stale value stays below a newer one and no
deleted key comes back. Each tier operation under the move is bounded too (:data:`TIER_TIMEOUT_S`);
30 s is the slowest tier operation the latency histograms bound (3 s) ten times."""

TIER_TIMEOUT_S = 10.0
"""Longest wait of the store for one operation of a tier below the first (a put, get, contains,
evict or release on the disk, shared filesystem or Mooncake tier; ``tier_timeout_s`` in kv_store's
config). On expiry the operation counts as :class:`TierUnavailable` (``timeouts`` and ``failures``,
the degraded path: a demotion goes on to the next tier or is lost, a write-through is dropped, a
read is a miss) and the caller goes on; the operation itself runs to its end (a thread blocked in
a hung filesystem cannot be stopped) and the store settles what it did then (:meth:`BlockStore._abandon`).
While a timed-out operation of a tier is still running, the tier's puts, gets and contains fail at
once (it is hung: no caller waits for it again); its evictions and releases are issued without
being awaited (they queue behind the hung one, run when it ends and are settled then; at most
:data:`MAX_HUNG_QUEUE`). The first tier (in memory) is not bounded: it never suspends. 10 s: the
slowest tier operation the latency histograms bound (3 s), three times, and a third of
:data:`SETTLE_TIMEOUT_S` (a move down crosses up to three slower tiers)."""
FAIL_FAST_VERBS = frozenset({"put", "get", "contains"})
"""Tier operations refused at once while a timed-out one of the tier still runs (see :data:`TIER_TIMEOUT_S`)."""
MAX_HUNG_QUEUE = 1024
"""Most operations of a hung tier the store has running at once (the timed-out ones and the evictions
and releases queued behind them); beyond it those are refused too (a sweep then leaves a copy there,
as when the tier is unavailable), so a long hang under a stream of puts holds bounded memory."""

ERROR_LOG_INTERVAL_S = 10.0
"""At most one ERROR line per failing tier this often (the count of suppressed lines follows)."""

T = TypeVar("T")
log = logging.getLogger(__name__)

Unplaced = tuple[int, str, bytes, tuple[int, asyncio.Event]]
"""A victim of a promotion's cascade that no tier took: (index of the tier holding it pending, key,
value, its move, ended once the undo restored or released it)."""


@dataclass(frozen=True, slots=True)
class StoredValue:
    """A value read from the store and the medium it came from."""

    value: bytes
    medium: Medium
    tier: str = ""


@dataclass(frozen=True, slots=True)
class PutOutcome:
    """Where a put landed, how many keys the first tier evicted (demoted or dropped) to make room,
    and how many evicted values (at any depth of the cascade) no slower tier could take: lost."""

    medium: Medium
    evicted: int
    lost: int = 0


@dataclass(slots=True)
class Histogram:
    """Cumulative-ready bucket counts over :data:`LATENCY_BUCKETS_S` (last slot is +Inf) and a sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total += seconds


@dataclass(slots=True)
class StoreMetrics:
    """Per-tier movement and latency, keyed by tier name."""

    latency: dict[tuple[str, str], Histogram] = field(default_factory=dict)
    """(tier, verb) -> histogram of seconds; verbs: put, get, contains, evict."""
    moved_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tier, reason) -> bytes written into the tier for that reason."""
    dropped: dict[tuple[str, str], int] = field(default_factory=dict)
    """(tier, reason) -> values a demotion or write-through could not place there; reasons
    :data:`DROP_REASONS` (failed: ``unavailable``, ``full``; the value exceeds the tier: ``too_large``)."""
    lost: dict[str, int] = field(default_factory=dict)
    """tier -> values the tier evicted that no slower tier took (each below failed or was too small)."""
    failures: dict[str, int] = field(default_factory=dict)
    """tier -> operations that raised TierUnavailable / StorageFull (the tier was skipped)."""
    promotions_undone: int = 0
    """Promotions rolled back because a value they evicted found no tier (the read lost nothing)."""
    promotions_superseded: int = 0
    """Promotions dropped because a put or delete of the key ran meanwhile (the read value was stale)."""
    settle_timeouts: int = 0
    """Puts and deletes that stopped waiting for a move down of their key after :data:`SETTLE_TIMEOUT_S`."""
    timeouts: dict[str, int] = field(default_factory=dict)
    """tier -> operations the store stopped waiting for after :data:`TIER_TIMEOUT_S` (each also in
    ``failures``: the tier was treated as unavailable)."""


@dataclass(slots=True)
class _KeyWatch:
    """The calls in flight on one key, and what a promotion needs to know of them."""

    refs: int = 0
    """Gets, puts and deletes of the key in flight (the slot is dropped at 0)."""
    writes: int = 0
    """Puts and deletes begun since the slot was made (a put that stored nothing takes its count back)."""
    writing: int = 0
    """Puts and deletes in flight."""
    promoted: int = 0
    """Promotions that stored the key in the first tier (a get that missed everywhere meanwhile looks again)."""
    landed: list[tuple[int, int, bytes]] = field(default_factory=list)
    """(move number, tier index, value) of each move down of the key that landed while a write was
    in flight: a put's sweep keeps the copies of its own value that moved down during the put."""
    sweep: tuple[asyncio.Event, bytes | None] | None = None
    """A put's (its value) or delete's (``None``) sweep of the slower tiers in progress: a move down
    of the key waits for it, then lands only a value equal to the swept one (older ones are stale)."""


def _short(key: str) -> str:
    """``key`` for a log line: at most 120 characters."""
    return key if len(key) <= 120 else key[:120] + "..."


def validate_key(key: str, where: str = "key") -> None:
    """Raises :class:`InvalidRequest` for an empty or over-long key, naming it ``where`` (``keys[2]``)."""
    if not key:
        raise InvalidRequest(f"{where} must not be empty")
    if len(key) > MAX_KEY_BYTES // 4 and len(key.encode()) > MAX_KEY_BYTES:  # <= 4 UTF-8 bytes per character
        raise InvalidRequest(f"{where} of {len(key.encode())} bytes exceeds {MAX_KEY_BYTES} bytes")


def validate_keys(keys: Sequence[str], call: str) -> None:
    """Every key of a many-key call (``Contains``, ``Lookup``, ``BatchGet``) as :func:`validate_key`
    checks one, before anything is read or answered: the same key is refused the same way by every
    call, and a many-key call fails whole or not at all.

    Raises:
        InvalidRequest: more than :data:`MAX_CONTAINS_KEYS` keys, or a bad key (named ``keys[i]``).
    """
    if len(keys) > MAX_CONTAINS_KEYS:
        raise InvalidRequest(f"{len(keys)} keys in one {call} call, at most {MAX_CONTAINS_KEYS}")
    for index, key in enumerate(keys):
        if not key or len(key) > MAX_KEY_BYTES // 4:
            validate_key(key, f"keys[{index}]")


class BlockStore:
    """Values by key over ordered tiers (see the module docstring).

    Args:
        tiers: fastest first; names must be unique.
        write_through: names of (usually shared) tiers that receive every put synchronously.
        promote_on_hit: copy a hit in a slower tier into the first tier.
        clock: seconds for latency histograms (``time.perf_counter``; tests pass a deterministic one).
        on_events: called after each operation with the vLLM KV events of the residency changes
            of described values (one batch; :mod:`services.kv_store.residency`), never with an
            empty list. None: residency is still tracked, events are dropped.
        settle_timeout_s: longest wait of a put or delete for the moves down of its key
            (:data:`SETTLE_TIMEOUT_S`).
        tier_timeout_s: longest wait for one operation of a tier below the first
            (:data:`TIER_TIMEOUT_S`); ``None``: unbounded.
    """

    def __init__(
        self,
        tiers: Sequence[StoreTier],
        *,
        write_through: Sequence[str] = (),
        promote_on_hit: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        on_events: Callable[[list[KVEvent]], None] | None = None,
        settle_timeout_s: float = SETTLE_TIMEOUT_S,
        tier_timeout_s: float | None = TIER_TIMEOUT_S,
    ) -> None:
        if not tiers:
            raise ValueError("a BlockStore needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        unknown = set(write_through) - set(names[1:])
        if unknown:
            raise ValueError(f"write_through names {sorted(unknown)} that are not slower tiers of {names}")
        self.tiers = list(tiers)
        self.write_through = frozenset(write_through)
        self.promote_on_hit = promote_on_hit
        self.metrics = StoreMetrics()
        self._clock = clock
        self._error_log = RateLimitedLog(log, ERROR_LOG_INTERVAL_S)
        self.residency = Residency({tier.name: tier.medium for tier in self.tiers})
        self.on_events = on_events
        self._moving: dict[str, list[tuple[int, asyncio.Event]]] = {}
        """key -> its moves down in flight (start number, set when the victim was released)."""
        self._move_seq = 0
        self._superseded_moves: set[int] = set()
        """Moves whose value is stale by the time they land (a write stopped waiting for them): the
        copy they land is removed at once, wherever it lands."""
        self._duplicate_moves: set[int] = set()
        """Moves whose source copy a promotion removed (the value is in the first tier now): the copy
        they land in a private tier is removed at once (one copy per instance); in a shared or
        written-through tier it stays (the block is then on both media, as after a promotion out
        of that tier). Writes of the key wait for them as for any move."""
        self._storing: dict[str, list[tuple[int, int, asyncio.Event]]] = {}
        """key -> (move number, tier index, set once stored and recorded) of each move of the key
        whose put into a slower tier is in flight: a sweep waits for those into the tier it is about
        to clear (:meth:`_sweep`)."""
        self.settle_timeout_s = settle_timeout_s
        self.tier_timeout_s = tier_timeout_s
        self._hung: dict[str, int] = {}
        """tier -> its operations that timed out and still run (see :data:`TIER_TIMEOUT_S`)."""
        self._abandoned: set[asyncio.Future[Any]] = set()
        """Timed-out tier operations and the work settling them, kept referenced until done."""
        self._moved_up = 0
        """Promotions that stored a key in the first tier (a contains that missed meanwhile looks again)."""
        self._watched: dict[str, _KeyWatch] = {}
        """key -> the calls in flight on it: how a promotion sees it was superseded."""
        self.republished = self.adopt_rescanned()
        """Values found by the tiers' start-up rescans and published again (described ones)."""

    def adopt_rescanned(self) -> int:
        """Describe and publish what the tiers' rescans found (see the module docstring); the count.

        Called at construction (file tiers rescan when built) and again after an asynchronous
        rescan (:meth:`MooncakeTier.rescan`); each tier hands over its rescanned values once.
        """
        count = 0
        for tier in self.tiers:
            take = getattr(tier, "take_rescanned", None)
            if take is None:
                continue
            for key, meta in take():
                if not meta:
                    continue  # put without a description: stored and served, never published
                if not self.residency.described(key):
                    try:
                        self.residency.describe(key, parse_block_event(meta))
                    except BadBlockEvent:
                        continue
                self.residency.added(key, tier.name)
                count += 1
                if count % REPUBLISH_BATCH == 0:
                    self._flush()
        self._flush()
        return count

    def _flush(self) -> None:
        events = self.residency.take_events()
        if events and self.on_events is not None:
            self.on_events(events)

    @property
    def max_value_bytes(self) -> int:
        """The largest value a put accepts (the placement tier's capacity)."""
        return self.tiers[0].capacity_bytes

    def check_value_size(self, key: str, total_bytes: int) -> None:
        """Validate a put before its bytes arrive.

        Raises:
            InvalidRequest: bad key. ValueTooLarge: ``total_bytes > max_value_bytes``.
        """
        validate_key(key)
        if total_bytes > self.max_value_bytes:
            raise ValueTooLarge(
                f"value of {total_bytes} bytes for key {key!r} exceeds the store's capacity of"
                f" {self.max_value_bytes} bytes"
            )

    # -- instrumentation -------------------------------------------------------------------

    async def _timed(
        self, tier: StoreTier, verb: str, op: Coroutine[object, object, T], late: Callable[[T], None] | None = None
    ) -> T:
        """Await the tier operation ``op`` (its latency observed), bounded by :attr:`tier_timeout_s`
        below the first tier (see :data:`TIER_TIMEOUT_S`); ``late`` settles what a timed-out
        operation did once it ends (given its result).

        Raises what ``op`` raises; TierUnavailable when it timed out, or when the tier is hung and
        ``verb`` is one of :data:`FAIL_FAST_VERBS` (``op`` is then never run).
        """
        start = self._clock()
        try:
            if self.tier_timeout_s is None or tier is self.tiers[0]:
                return await op
            return await self._bounded(tier, verb, op, late)
        finally:
            hist = self.metrics.latency.get((tier.name, verb))
            if hist is None:
                hist = self.metrics.latency[(tier.name, verb)] = Histogram()
            hist.observe(self._clock() - start)

    async def _bounded(
        self, tier: StoreTier, verb: str, op: Coroutine[object, object, T], late: Callable[[T], None] | None
    ) -> T:
        """:meth:`_timed`'s bound: ``op`` runs in its own task, awaited at most :attr:`tier_timeout_s`.

        While the tier is hung (a timed-out operation of it still runs) a put, get or contains is
        refused and an eviction or release is issued but not awaited (it queues behind the hung
        one and is settled when it ends; refused too beyond :data:`MAX_HUNG_QUEUE`): both raise
        TierUnavailable at once.

        A cancelled caller cancels ``op`` too and waits (at most the bound again) for it to end, as
        an unbounded await would (a file tier's mutation runs to its end first); one still running
        then is abandoned as a timed-out one.
        """
        hung = self._hung.get(tier.name, 0)
        why = f"{tier.name} tier is hung: {hung} operation(s) timed out after {self.tier_timeout_s} s and still run"
        if hung and (verb in FAIL_FAST_VERBS or hung >= MAX_HUNG_QUEUE):
            op.close()
            raise TierUnavailable(why)
        assert self.tier_timeout_s is not None
        task = asyncio.ensure_future(op)
        if hung:
            self._abandon(tier, verb, task, late, timed_out=False)
            raise TierUnavailable(why)
        try:
            done, _ = await asyncio.wait((task,), timeout=self.tier_timeout_s)
        except asyncio.CancelledError:
            task.cancel()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.tier_timeout_s
            while not task.done() and loop.time() < deadline:
                try:
                    await asyncio.wait((task,), timeout=max(0.0, deadline - loop.time()))
                except asyncio.CancelledError:
                    continue
            if task.done():
                if not task.cancelled():
                    task.exception()  # retrieved: the caller sees its cancellation
            else:
                self._abandon(tier, verb, task, None, timed_out=True)
            raise
        if done:
            return task.result()
        self._abandon(tier, verb, task, late, timed_out=True)
        raise TierUnavailable(
            f"{tier.name} tier: {verb} did not finish within {self.tier_timeout_s} s (a hung medium?)"
        )

    def _abandon(
        self, tier: StoreTier, verb: str, task: asyncio.Future[T], late: Callable[[T], None] | None,
        *, timed_out: bool,
    ) -> None:
        """The store does not wait for ``task`` (a ``verb`` of ``tier``; ``timed_out``: counted in
        ``timeouts``, else issued to a hung tier): the tier is hung until it ends, and what it did
        then is settled by ``late`` (given its result)."""
        self._hung[tier.name] = self._hung.get(tier.name, 0) + 1
        self._abandoned.add(task)
        if timed_out:
            self.metrics.timeouts[tier.name] = self.metrics.timeouts.get(tier.name, 0) + 1
            self._error_log.log(
                logging.ERROR, f"timeout:{tier.name}",
                "tier %s: %s still running after %.1f s (a hung medium?); the tier counts as unavailable"
                " until it ends", tier.name, verb, self.tier_timeout_s,
            )

        def ended(task: asyncio.Future[T]) -> None:
            self._abandoned.discard(task)
            left = self._hung.get(tier.name, 0) - 1
            if left > 0:
                self._hung[tier.name] = left
            else:
                self._hung.pop(tier.name, None)
            if task.cancelled():
                return
            exc = task.exception()
            if exc is not None:
                log.info("tier %s: the timed-out %s ended with %s: %s", tier.name, verb, type(exc).__name__, exc)
            elif late is not None:
                late(task.result())
            if left <= 0 and timed_out:
                log.info("tier %s: the timed-out %s ended; the tier is used again", tier.name, verb)

        task.add_done_callback(ended)

    def _spawn(self, work: Coroutine[object, object, object]) -> None:
        """Run ``work`` (settling a timed-out operation) in its own task, kept referenced; its errors logged."""
        task = asyncio.ensure_future(work)
        self._abandoned.add(task)

        def ended(task: asyncio.Future[object]) -> None:
            self._abandoned.discard(task)
            if not task.cancelled() and task.exception() is not None:
                log.error("settling a timed-out tier operation failed", exc_info=task.exception())

        task.add_done_callback(ended)

    async def _evict(self, tier: StoreTier, key: str) -> bool:
        """Remove ``key`` from ``tier`` (its residency too); ``True`` when the tier held it. An
        eviction that timed out and removes the key later marks it removed then.

        Raises TierUnavailable / StorageFull (callers count them as a degraded operation).
        """

        def late(removed: bool) -> None:
            if removed:
                self.residency.removed(key, tier.name)
                self._flush()

        removed = await self._timed(tier, "evict", tier.evict(key), late)
        if removed:
            self.residency.removed(key, tier.name)
        return removed

    def _late_put(
        self, index: int, key: str, value: bytes, reason: str, move: int | None = None
    ) -> Callable[[PutResult], None]:
        """What settles a timed-out put of ``key`` into ``tiers[index]`` that stored the value after all.

        The store counted that put a failure and went on: a demotion or restore placed the value
        further down or counted it lost, so the copy landed late is removed (one copy per
        instance, nothing counted twice), unless another move of the key (not ``move``, the one
        this put was part of) or a write of it is in flight by then: that one may have written a
        newer value there, which a removal would take, and its own sweep or landing settles the
        tier, so the copy is kept (and published). A late write-through is kept and published
        (the tier's lock orders it before any later write or delete of the key there). Either way
        the victims the late put handed out are demoted on down (or released and counted lost),
        as any put's.
        """
        tier = self.tiers[index]

        def late(result: PutResult) -> None:
            watch = self._watched.get(key)
            busy = any(seq != move for seq, _ in self._moving.get(key, ())) or (
                watch is not None and watch.writing > 0
            )
            keep = reason == "write_through" or busy
            if keep:  # the tier holds it: so does its residency (whoever removes it later says so)
                self._moved(tier, reason, len(value))
                self.residency.added(key, tier.name)
                self._flush()
            self._spawn(self._settle_late_put(index, key, not keep, result))

        return late

    async def _settle_late_put(self, index: int, key: str, remove: bool, result: PutResult) -> None:
        tier = self.tiers[index]
        try:
            if remove:
                try:
                    await self._evict(tier, key)
                except (TierUnavailable, StorageFull) as exc:
                    self._failed(tier, "evict", exc)
            await self._cascade(index, result, None)
        finally:
            self._flush()

    def _shares(self, tier: StoreTier) -> bool:
        """Whether a promotion out of ``tier`` leaves its copy there: a shared tier (other instances
        read it) or one written through (it holds every put's value by design)."""
        return tier.shared or tier.name in self.write_through

    def _moved(self, tier: StoreTier, reason: str, size: int) -> None:
        key = (tier.name, reason)
        self.metrics.moved_bytes[key] = self.metrics.moved_bytes.get(key, 0) + size

    def _failed(self, tier: StoreTier, op: str, exc: Exception) -> None:
        self.metrics.failures[tier.name] = self.metrics.failures.get(tier.name, 0) + 1
        self._error_log.log(
            logging.ERROR, f"tier:{tier.name}", "degraded mode tier=%s op=%s error=%s: %s",
            tier.name, op, type(exc).__name__, exc,
        )

    def _dropped(self, tier: StoreTier, op: str, key: str, exc: Exception) -> None:
        """``tier`` did not take a demotion or write-through of ``key``: counted by reason; a failure
        of the tier is also a degraded operation (ERROR), a value too large for it is not (DEBUG)."""
        if isinstance(exc, ValueTooLarge):
            reason = "too_large"
            log.debug("%s of key=%r skipped tier %s: %s", op, _short(key), tier.name, exc)
        else:
            reason = "full" if isinstance(exc, StorageFull) else "unavailable"
            self._failed(tier, op, exc)
        slot = (tier.name, reason)
        self.metrics.dropped[slot] = self.metrics.dropped.get(slot, 0) + 1

    def dropped(self, tier: str) -> int:
        """Values ``tier`` did not take (demotions and write-throughs), every reason together."""
        return sum(count for (name, _), count in self.metrics.dropped.items() if name == tier)

    # -- placement ---------------------------------------------------------------------------

    async def _store(self, index: int, key: str, value: bytes, reason: str, move: int | None = None) -> PutResult:
        """Put into ``tiers[index]`` alone (its victims kept when a slower tier exists); the key is
        readable there once this returns. ``move``: the number of the move down this put is part of.
        Raises what ``tiers[index].put`` raises (TierUnavailable when it timed out: see
        :meth:`_late_put` for what settles it)."""
        tier = self.tiers[index]
        last = index + 1 >= len(self.tiers)
        meta = self.residency.encoded(key)  # kept by tiers that survive a restart
        result = await self._timed(
            tier, "put", tier.put(key, value, keep_victims=not last, meta=meta),
            self._late_put(index, key, value, reason, move),
        )
        self._moved(tier, reason, len(value))
        self.residency.added(key, tier.name)
        return result

    async def _cascade(self, index: int, result: PutResult, unplaced: list[Unplaced] | None) -> int:
        """Demote the victims of a put into ``tiers[index]`` downwards; the values none took (see
        :meth:`_place`).

        Each victim is still readable in ``tiers[index]`` (pending there, see
        :mod:`services.kv_store.tiers.base`) until a slower tier stored it; only then is it
        released, so a move down is a store, then a removal, and a concurrent get or contains
        finds the value throughout. A victim no tier took is released too (an eviction, counted
        lost), unless ``unplaced`` collects it (a promotion's undo then restores or releases it).

        Interrupted (cancelled, or an unexpected error mid-cascade): the victims not yet placed are
        never left pending. A tier whose contents survive a restart (``reinstate``: file tiers,
        Mooncake) takes them back (nothing is lost; they are evicted again by a later put); any
        other tier releases them and they are counted lost.
        """
        tier = self.tiers[index]
        handed = {victim for victim, _ in result.victims}
        for victim in result.evicted:
            if victim not in handed:  # unreadable (corrupt, gone): removed by the put already
                self.residency.removed(victim, tier.name)
        moves = [self._start_move(victim) for victim, _ in result.victims]
        placed = [[False] for _ in moves]  # set once a slower tier stored the victim
        lost = 0
        done = 0
        try:
            for (victim, victim_value), move, stored in zip(result.victims, moves, placed, strict=True):
                waiting = len(unplaced) if unplaced is not None else 0
                lost += await self._demote(index + 1, victim, victim_value, unplaced, move, stored)
                done += 1
                if unplaced is not None and (index, victim, victim_value, move) in unplaced[waiting:]:
                    continue  # no tier took it: still pending here, the promotion's undo decides
                try:
                    await self._release(tier, [(victim, victim_value)])
                finally:
                    self._end_move(victim, move)
        finally:
            rest = result.victims[done:]
            if rest:  # cancelled or failed mid-cascade: never leave victims pending
                try:
                    below = [victim for victim, stored in zip(rest, placed[done:], strict=True) if stored[0]]
                    astray = [victim for victim, stored in zip(rest, placed[done:], strict=True) if not stored[0]]
                    reinstate = getattr(tier, "reinstate", None)
                    back = reinstate(astray) if reinstate is not None and astray else [False] * len(astray)
                    gone = [victim for victim, kept in zip(astray, back, strict=True) if not kept]
                    for victim, victim_value in gone:
                        self._lost(tier.name, victim, len(victim_value))
                    if below or gone:
                        await self._release(tier, below + gone)
                finally:
                    for (victim, _), move in zip(rest, moves[done:], strict=True):
                        self._end_move(victim, move)
        return lost

    def _start_move(self, key: str) -> tuple[int, asyncio.Event]:
        """A victim of ``key`` is pending in its tier and moving down (until :meth:`_end_move`).

        Older superseded moves of the key still in flight stay superseded: what they land is removed
        where it lands, unless this newer move's put into that same tier is queued behind theirs
        (it then replaces the stale copy, which a removal would take with it; :meth:`_landed`).
        """
        self._move_seq += 1
        move = (self._move_seq, asyncio.Event())
        self._moving.setdefault(key, []).append(move)
        return move

    def _end_move(self, key: str, move: tuple[int, asyncio.Event]) -> None:
        move[1].set()
        self._superseded_moves.discard(move[0])
        self._duplicate_moves.discard(move[0])
        moves = self._moving.get(key)
        if moves is not None and move in moves:
            moves.remove(move)
            if not moves:
                del self._moving[key]

    async def _settled(self, key: str, stale_up_to: int | None = None, deadline: float | None = None) -> bool:
        """Wait until no move down of ``key`` is in flight, at most :attr:`settle_timeout_s`.

        A put or delete waits so that an older value of its key, pending in a tier and on its way
        down, lands before the write (which then replaces or sweeps it) instead of after it (a
        stale copy below a newer value, or a deleted key back). Moves wait only for a write's
        sweep (:meth:`_sweep`), which waits for no write (only for moves' tier puts in flight,
        each bounded). On expiry (a hung tier) the wait ends
        (``settle_timeouts``, a WARNING) and the moves still in flight numbered up to
        ``stale_up_to`` (``None``: all) are superseded: what they land is removed where it lands.
        Superseded moves are not waited for. ``deadline`` (``loop.time()``): one budget for the
        several waits of one write. ``False`` when the wait expired (the write waits no more).
        """
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + self.settle_timeout_s
        while True:
            moves = [move for move in self._moving.get(key, ()) if move[0] not in self._superseded_moves]
            if not moves:
                return True
            try:
                await asyncio.wait_for(moves[0][1].wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                stale = [seq for seq, _ in self._moving.get(key, ()) if stale_up_to is None or seq <= stale_up_to]
                self._superseded_moves.update(stale)
                self.metrics.settle_timeouts += 1
                log.warning(
                    "key=%r: %d move(s) down still in flight after %.1f s (a hung tier?); the write goes"
                    " on, %d stale move(s) superseded",
                    _short(key), len(self._moving.get(key, ())), self.settle_timeout_s, len(stale),
                )
                return False

    async def _release(self, tier: StoreTier, victims: Sequence[tuple[str, bytes]]) -> None:
        """Release pending victims of ``tier`` (a slower tier took them, or none could); a victim a
        put replaced or a delete removed meanwhile stays as that write left it."""
        try:
            released = await self._timed(tier, "evict", tier.release(victims))
        except ReleaseFailed as exc:  # the ones that were still pending are no longer
            self._failed(tier, "release", exc)
            released = exc.released
        except (TierUnavailable, StorageFull) as exc:
            self._failed(tier, "release", exc)
            released = [True] * len(victims)  # a tier that cannot say: assume it dropped them from its view
        for (victim, _), gone in zip(victims, released, strict=True):
            if gone:
                self.residency.removed(victim, tier.name)

    async def _place(
        self, index: int, key: str, value: bytes, reason: str, unplaced: list[Unplaced] | None = None
    ) -> tuple[int, int]:
        """Put into ``tiers[index]`` and demote its victims downwards.

        Returns ``(evicted, lost)``: the keys ``tiers[index]`` evicted for this value, and the values
        of this call's cascade (those victims, and theirs further down) that no slower tier took.
        Counted along this call only, so concurrent calls never see each other's figures. With
        ``unplaced`` (a promotion), a value no tier took is appended there instead of counted lost:
        the caller restores it.

        Raises what ``tiers[index].put`` raises (callers below the first tier guard it).
        """
        result = await self._store(index, key, value, reason)
        return len(result.evicted), await self._cascade(index, result, unplaced)

    async def _demote(
        self,
        index: int,
        key: str,
        value: bytes,
        unplaced: list[Unplaced] | None = None,
        move: tuple[int, asyncio.Event] | None = None,
        stored: list[bool] | None = None,
    ) -> int:
        """Place a victim of ``tiers[index - 1]`` in ``tiers[index]``, else the first slower tier
        that takes it; counted lost (by the evicting tier) when none does, or appended to
        ``unplaced`` when given (see :meth:`_place`).

        Returns the values this demotion lost: 1 when no tier took ``key``, else what the cascade
        below the tier that took it lost.

        A move (``move`` given) first waits for a put's or delete's sweep of ``key`` in progress;
        a value the sweep superseded (not the swept put's value, or a deleted key) lands nowhere
        (0: not a loss). Where a move lands is recorded while a write of the key is in flight (the
        put's sweep keeps it, :meth:`_sweep`); a superseded move's copy is removed where it lands.
        While a move's put into a tier is in flight, a sweep of the key waits for it before it
        clears that tier (:meth:`_begin_store`).
        """
        if move is not None:
            watch = self._watched.get(key)
            if watch is not None and watch.sweep is not None:
                swept: bytes | None = None
                while watch.sweep is not None:
                    swept_event, swept = watch.sweep
                    await swept_event.wait()
                if swept is None or not (value is swept or value == swept):
                    return 0  # stale: the sweep removed its source copy (or will see it released)
        for tier_index in range(index, len(self.tiers)):
            tier = self.tiers[tier_index]
            if tier.name in self.write_through and (await self._safe_contains(tier, [key]))[0]:
                self.residency.added(key, tier.name)
                return 0  # already there: written through at put time
            storing = None if move is None else self._begin_store(key, move, tier_index)
            try:
                try:
                    result = await self._store(tier_index, key, value, "demote", None if move is None else move[0])
                except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                    self._dropped(tier, "demote", key, exc)
                    continue
                if stored is not None:
                    stored[0] = True
                if move is not None:
                    await self._landed(key, move, tier_index, value)
            finally:
                if storing is not None:
                    self._end_store(key, storing)
            return await self._cascade(tier_index, result, unplaced)
        if unplaced is not None and move is not None:
            unplaced.append((index - 1, key, value, move))
            return 0
        self._lost(self.tiers[index - 1].name, key, len(value))
        return 1

    def _begin_store(self, key: str, move: tuple[int, asyncio.Event], index: int) -> tuple[int, int, asyncio.Event]:
        """A move of ``key`` is about to put its value into ``tiers[index]`` (until :meth:`_end_store`,
        once stored and recorded by :meth:`_landed`, or refused)."""
        storing = (move[0], index, asyncio.Event())
        self._storing.setdefault(key, []).append(storing)
        return storing

    def _end_store(self, key: str, storing: tuple[int, int, asyncio.Event]) -> None:
        storing[2].set()
        entries = self._storing.get(key)
        if entries is not None and storing in entries:
            entries.remove(storing)
            if not entries:
                del self._storing[key]

    async def _stores_into(self, key: str, index: int) -> None:
        """Wait until no move of ``key`` is putting its value into ``tiers[index]`` (each such put is
        bounded by :attr:`tier_timeout_s`; the wait, by :attr:`settle_timeout_s` in all)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout_s
        while True:
            pending = [done for _, at, done in self._storing.get(key, ()) if at == index]
            if not pending:
                return
            try:
                await asyncio.wait_for(pending[0].wait(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return

    async def _landed(self, key: str, move: tuple[int, asyncio.Event], index: int, value: bytes) -> None:
        """A move of ``key`` stored ``value`` in ``tiers[index]``: recorded for a write of the key
        in flight; removed there at once when the move was superseded (see ``_superseded_moves``),
        or when a promotion took its source and the tier is private (``_duplicate_moves``: a
        shared or written-through tier keeps it, and the block is on both media)."""
        tier = self.tiers[index]
        if move[0] in self._superseded_moves or (move[0] in self._duplicate_moves and not self._shares(tier)):
            if any(seq != move[0] and at == index for seq, at, _ in self._storing.get(key, ())):
                return  # a newer move's put there is queued behind this one: it replaces this copy
            try:
                await self._evict(tier, key)
            except (TierUnavailable, StorageFull) as exc:
                self._failed(tier, "evict", exc)
            return
        watch = self._watched.get(key)
        if watch is not None and watch.writing > 0:
            watch.landed.append((move[0], index, value))

    def _lost(self, source: str, key: str, size: int) -> None:
        self.metrics.lost[source] = self.metrics.lost.get(source, 0) + 1
        self._error_log.log(
            logging.ERROR, f"lost:{source}",
            "value lost: key=%r (%d bytes) evicted from tier %s and no slower tier could take it",
            _short(key), size, source,
        )

    async def _safe_contains(self, tier: StoreTier, keys: Sequence[str]) -> list[bool]:
        try:
            return await self._timed(tier, "contains", tier.contains(keys))
        except (TierUnavailable, StorageFull) as exc:
            self._failed(tier, "contains", exc)
            return [False] * len(keys)

    async def put(self, key: str, value: bytes, block: BlockStored | None = None) -> PutOutcome:
        """Store ``value`` in the first tier (see the module docstring).

        ``block``: the engine's ``BlockStored`` for this value (one block, checked by
        :func:`services.kv_store.residency.parse_block_event`); the value's residency is then
        published as KV events.

        Raises:
            InvalidRequest: bad key. ValueTooLarge: larger than the first tier.
            TierUnavailable / StorageFull: the first tier failed (nothing stored).
        """
        self.check_value_size(key, len(value))
        deadline = asyncio.get_running_loop().time() + self.settle_timeout_s
        waiting = await self._settled(key, None, deadline)  # an older value moving down lands before this write
        watch = self._begin_write(key)
        if block is not None:
            self.residency.describe(key, block)
        try:
            try:
                result = await self._store(0, key, value, "put")
            except BaseException:
                watch.writes -= 1  # stored nothing: no promotion needs to step aside for it
                raise
            stored_at = self._move_seq  # moves begun after this may be of this value
            evicted, lost = len(result.evicted), await self._cascade(0, result, None)
            if waiting:  # an older value evicted while this one was written
                waiting = await self._settled(key, stored_at, deadline)
            for index, tier in enumerate(self.tiers[1:], 1):
                if tier.name not in self.write_through:
                    continue
                try:  # the write-through tier's victims move down (or are evicted: removed, counted)
                    _, wt_lost = await self._place(index, key, value, "write_through")
                    lost += wt_lost
                except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                    self._dropped(tier, "write_through", key, exc)
            if waiting:  # no move of the key in flight past this point (unless a tier hangs)
                await self._settled(key, stored_at, deadline)
            await self._sweep(key, watch, value, stored_at)
        finally:
            self._end_write(key, watch)
            self.residency.forget_if_absent(key)
            self._flush()
        return PutOutcome(self.tiers[0].medium, evicted, lost)

    def get_nowait(self, key: str) -> StoredValue | None:
        """A first-tier hit served without suspending, or ``None``: then :meth:`get` (which also
        finds the key in slower tiers and promotes it). Only a first tier that can answer at once
        (the CPU tier's ``get_nowait``) answers here; the hit is counted and timed as ``get``'s.
        For the ``lm://`` and gRPC read paths, where a CPU hit needs no task of its own.

        Raises:
            InvalidRequest: bad key.
        """
        tier = self.tiers[0]
        peek = getattr(tier, "get_nowait", None)
        if peek is None:
            return None
        validate_key(key)
        start = self._clock()
        value = peek(key)
        if value is None:
            return None
        hist = self.metrics.latency.get((tier.name, "get"))
        if hist is None:
            hist = self.metrics.latency[(tier.name, "get")] = Histogram()
        hist.observe(self._clock() - start)
        return StoredValue(value, tier.medium, tier.name)

    async def get(self, key: str) -> StoredValue:
        """The value from the fastest tier holding it, promoted to the first tier on a slower hit.

        A get that misses everywhere while a concurrent get of the key promoted it (the key moved
        up past this one's scan) looks again, so a stored key is never missed for being moved.

        Raises:
            InvalidRequest: bad key. KeyNotFound: no reachable tier holds ``key``.
        """
        validate_key(key)
        watch = self._enter(key)
        writes, busy = watch.writes, watch.writing > 0

        def superseded() -> bool:
            # a put or delete in flight when the read began, or begun since: the read may be stale
            return busy or watch.writes != writes

        try:
            for _ in range(1 + MISS_RESCANS):
                promoted = watch.promoted
                for index, tier in enumerate(self.tiers):
                    try:
                        value = await self._timed(tier, "get", tier.get(key))
                    except (TierUnavailable, StorageFull) as exc:
                        self._failed(tier, "get", exc)
                        continue
                    if value is None:
                        self.residency.removed(key, tier.name)  # dropped behind our back (corrupt, Mooncake eviction)
                        continue
                    self.residency.added(key, tier.name)  # a shared value another instance wrote is adopted
                    if index > 0 and self.promote_on_hit and len(value) <= self.max_value_bytes:
                        await self._promote(index, key, value, watch, superseded)
                    return StoredValue(value, tier.medium, tier.name)
                if watch.promoted == promoted:
                    break
        finally:
            self._leave(key, watch)
            self._flush()
        raise KeyNotFound(f"key {key!r} not found")

    async def _sweep(self, key: str, watch: _KeyWatch, value: bytes | None, stored_at: int = 0) -> bool:
        """Remove ``key`` from the slower tiers (all of them: a delete, ``value`` None) that are not
        written through, keeping the copies of ``value`` that moves begun after ``stored_at`` landed
        (the put's own value, evicted from the first tier and moved down during the put).

        Called with no move of ``key`` in flight (after :meth:`_settled`, no suspension between):
        a move of ``key`` begun during the sweep waits for it, then lands only ``value``. After a
        settle timeout moves of ``key`` may still be in flight: before it clears a tier the sweep
        waits for a move's put into that tier in flight (:meth:`_stores_into`, bounded), then keeps
        the copy when it is ``value`` (a move of the put's own value landing there during the sweep
        is never removed by it). ``True`` when any tier held the key (removed)."""
        event = asyncio.Event()
        watch.sweep = (event, value)
        removed = False

        def kept(index: int) -> bool:  # a copy of the put's own value landed there during the put
            return value is not None and any(
                at == index and seq > stored_at and (landed is value or landed == value)
                for seq, at, landed in watch.landed
            )

        try:
            for index, tier in enumerate(self.tiers):
                if value is not None and (index == 0 or tier.name in self.write_through):
                    continue
                if index > 0 and key in self._storing:  # a move landing there now: see what it lands first
                    await self._stores_into(key, index)
                if kept(index):
                    continue
                try:
                    if await self._evict(tier, key):
                        removed = True
                except (TierUnavailable, StorageFull) as exc:
                    self._failed(tier, "delete" if value is None else "evict", exc)
        finally:
            if watch.sweep is not None and watch.sweep[0] is event:
                watch.sweep = None
            event.set()
        return removed

    def _enter(self, key: str) -> _KeyWatch:
        watch = self._watched.get(key)
        if watch is None:
            watch = self._watched[key] = _KeyWatch()
        watch.refs += 1
        return watch

    def _leave(self, key: str, watch: _KeyWatch) -> None:
        watch.refs -= 1
        if watch.refs == 0 and self._watched.get(key) is watch:
            del self._watched[key]

    def _begin_write(self, key: str) -> _KeyWatch:
        """A put or delete of ``key`` began: promotions of a value read before it are stale.

        Counted before the write's first tier operation is issued (no suspension in between), so a
        promotion that checks :meth:`get`'s ``superseded`` and then issues its own first-tier put
        (no suspension either) is ordered against it on that tier.
        """
        watch = self._enter(key)
        watch.writes += 1
        watch.writing += 1
        return watch

    def _end_write(self, key: str, watch: _KeyWatch) -> None:
        watch.writing -= 1
        self._leave(key, watch)

    async def _promote(
        self, index: int, key: str, value: bytes, watch: _KeyWatch, superseded: Callable[[], bool]
    ) -> None:
        """Swap ``key`` (hit in ``tiers[index]``) into the first tier; see the module docstring.

        1. ``key`` is stored in the first tier, its victims kept aside: the key is readable at once
           (in the first tier, and in its old tier until step 2), so a concurrent get never misses it.
        2. The private copies between the first tier and the hit (the hit's own included) are
           removed, which frees the room the victims need.
        3. The victims are demoted into it (and on down); a value no tier takes is collected rather
           than lost, and if one was, the promotion is undone (:meth:`_undo`).

        ``superseded()`` is true once a put or delete of ``key`` was in flight when the read began
        or began after it. Checked before step 1 (the promotion is dropped) and again after it (a
        write that began meanwhile issued its first-tier operation after this promotion's, so it
        replaces or removes this copy there, and removes the slower copies itself: step 2 is
        skipped, the victims are still demoted). ``promotions_superseded`` counts both.
        """
        first = self.tiers[0]
        if superseded():
            self.metrics.promotions_superseded += 1
            return
        try:
            result = await self._store(0, key, value, "promote")
        except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
            self._failed(first, "promote", exc)
            return  # nothing moved: the key stays where it was read
        watch.promoted += 1
        self._moved_up += 1
        freed: list[int] = []
        if superseded():
            self.metrics.promotions_superseded += 1
        else:
            for tier_index in range(1, index + 1):
                tier = self.tiers[tier_index]
                if self._shares(tier):
                    continue
                try:
                    if await self._evict(tier, key):
                        freed.append(tier_index)
                except (TierUnavailable, StorageFull) as exc:
                    self._failed(tier, "evict", exc)
            if freed:  # a pending copy on its way down lost its source: what it lands is a second copy
                self._duplicate_moves.update(seq for seq, _ in self._moving.get(key, ()))
        unplaced: list[Unplaced] = []
        try:
            await self._cascade(0, result, unplaced)
            if unplaced:
                await self._undo(index, key, value, freed, unplaced, superseded)
        finally:
            for source, victim, victim_value, move in unplaced:  # interrupted: never leave them pending
                if not move[1].is_set():
                    try:
                        await self._release(self.tiers[source], [(victim, victim_value)])
                    finally:
                        self._end_move(victim, move)

    async def _undo(
        self,
        index: int,
        key: str,
        value: bytes,
        freed: list[int],
        unplaced: list[Unplaced],
        superseded: Callable[[], bool],
    ) -> None:
        """Roll back a promotion whose victims (``unplaced``) found no tier.

        ``key`` goes back first (to the fastest private tier it left, else on down; a shared hit
        still holds it), then leaves the first tier, then the victims return to the room it took:
        the key is readable throughout, and so are the victims (still pending in the tier that
        evicted them until restored or released). When ``key`` can go back nowhere (the tiers it
        left failed meanwhile, or a concurrent promotion removed the copy) it stays in the first
        tier and the victims are lost. Superseded meanwhile: the write owns the key; only the victims return.
        """
        self.metrics.promotions_undone += 1
        log.info("promotion of key=%r undone: %d value(s) it evicted found no tier", _short(key), len(unplaced))
        first = self.tiers[0]
        back = True
        if not superseded():
            back = await self._put_back(freed[0], key, value) if freed else self._shares(self.tiers[index])
            if back and not superseded():
                try:
                    await self._evict(first, key)
                except (TierUnavailable, StorageFull) as exc:
                    self._failed(first, "evict", exc)
        for source, victim, victim_value, move in unplaced:  # back into the room the promoted value took
            restored = False
            if back:
                try:
                    await self._place(0, victim, victim_value, "restore")
                    restored = True
                except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                    self._failed(first, "restore", exc)
            if not restored:
                self._lost(self.tiers[source].name, victim, len(victim_value))
            # pending in its tier until now (readable throughout); a restore into that same tier
            # replaced the pending copy, and releasing it is then a no-op
            try:
                await self._release(self.tiers[source], [(victim, victim_value)])
            finally:
                self._end_move(victim, move)

    async def _put_back(self, index: int, key: str, value: bytes) -> bool:
        """Store ``key`` in ``tiers[index]``, else the first slower tier that takes it (as
        :meth:`_demote`, losses of its cascade counted); ``False`` when none did."""
        for tier_index in range(index, len(self.tiers)):
            tier = self.tiers[tier_index]
            if tier.name in self.write_through and (await self._safe_contains(tier, [key]))[0]:
                self.residency.added(key, tier.name)
                return True
            try:
                await self._place(tier_index, key, value, "restore")
                return True
            except (TierUnavailable, StorageFull, ValueTooLarge) as exc:
                self._dropped(tier, "restore", key, exc)
        return False

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        """One flag per key, in order; no LRU effect.

        A key being moved is never reported absent: a victim moving down stays readable in its
        tier until a slower one holds it, and a scan that missed keys while a promotion moved keys
        up past it looks again for those (at most :data:`MISS_RESCANS` times), as :meth:`get` does.

        Raises:
            InvalidRequest: more than :data:`MAX_CONTAINS_KEYS` keys, or an empty or over-long key
                (:func:`validate_keys`: refused as ``get`` refuses it, not reported absent).
        """
        validate_keys(keys, "Contains")
        return [found is not None for found in await self._locate(keys)]

    async def media(self, keys: Sequence[str]) -> list[Medium | None]:
        """For each key the medium of the fastest tier holding it, ``None`` when absent; no LRU
        effect; rescans as :meth:`contains`.

        Raises:
            InvalidRequest: as :meth:`contains`.
        """
        validate_keys(keys, "Lookup")
        return [None if found is None else self.tiers[found].medium for found in await self._locate(keys)]

    async def _locate(self, keys: Sequence[str]) -> list[int | None]:
        """For each key the index of the fastest tier found holding it (``None``: absent), scanning
        the tiers in order, batched per tier; the keys still missing are scanned again when a
        promotion stored a key in the first tier during the scan (see :meth:`contains`)."""
        found: list[int | None] = [None] * len(keys)
        for _ in range(1 + MISS_RESCANS):
            moved_up = self._moved_up
            pending = [i for i, where in enumerate(found) if where is None]
            for index, tier in enumerate(self.tiers):
                if not pending:
                    return found
                flags = await self._safe_contains(tier, [keys[i] for i in pending])
                for i, hit in zip(pending, flags, strict=True):
                    if hit:
                        found[i] = index
                pending = [i for i, hit in zip(pending, flags, strict=True) if not hit]
            if not pending or self._moved_up == moved_up:
                break
        return found

    async def delete(self, key: str) -> bool:
        """Drop ``key`` from every reachable tier; ``True`` when any held it. Raises InvalidRequest.

        A move down of the key in flight lands first (the delete waits for it, and sweeps again
        for one that began during its sweep), so a moving value never comes back after a delete.
        """
        validate_key(key)
        deadline = asyncio.get_running_loop().time() + self.settle_timeout_s
        waiting = await self._settled(key, None, deadline)
        watch = self._begin_write(key)
        deleted = False
        try:
            for _ in range(1 + MISS_RESCANS):
                if waiting:  # no suspension before the sweep: moves begun later wait for it
                    waiting = await self._settled(key, None, deadline)
                deleted = await self._sweep(key, watch, None) or deleted
                if not waiting or key not in self._moving:
                    break
        finally:
            self._end_write(key, watch)
            self._flush()
        return deleted

    @property
    def abandoned(self) -> int:
        """Tier operations the store stopped waiting for that still run, and the work settling those
        that ended (see :data:`TIER_TIMEOUT_S`)."""
        return len(self._abandoned)

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the :attr:`abandoned` work to end (each is settled as it
        ends); returns how much still runs."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._abandoned and loop.time() < deadline:
            await asyncio.wait(set(self._abandoned), timeout=max(0.0, deadline - loop.time()))
        return len(self._abandoned)

    def keys(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` that some tier's view holds, each once, sorted.

        No I/O: the tiers' own indexes (a shared tier's is what this instance wrote, read or found
        on its rescan; Mooncake's client cannot list the cluster).
        """
        return sorted({key for tier in self.tiers for key in tier.held_keys() if key.startswith(prefix)})

    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]
