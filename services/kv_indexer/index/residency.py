"""Block-key residency changes, in order, for replicas (``KVIndexer/Watch``; epp's local prefix index).

The index records a :class:`ResidencyRecord` whenever an endpoint starts or stops holding a block key
on a medium (a refcount lane going 0 -> 1 or 1 -> 0, not every engine hash), or loses everything
(``cleared``: ``AllBlocksCleared``, a purge, a new incarnation). Records get consecutive sequence
numbers; watchers read what came after their position. The log is bounded in keys: a watcher that
falls behind what is kept gets None from :meth:`ResidencyLog.since` and must resync from a snapshot.

Recording only runs while a log is attached (a watcher exists); an index with no watcher pays one
``None`` test per stored or removed event. No I/O; one thread (the indexer's event loop).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice
from typing import NamedTuple


class ResidencyRecord(NamedTuple):
    """``endpoint_id`` on ``medium``: ``cleared`` (every key, every medium, goes first), then the keys
    it now holds (``added``) and no longer holds (``removed``)."""

    endpoint_id: str
    medium: str
    cleared: bool
    added: Sequence[int]
    removed: Sequence[int]


class ResidencyLog:
    """Ordered residency records with sequence numbers ``1, 2, ...``; keeps at most ``max_keys`` keys.

    Args:
        max_keys: keys kept across retained records (oldest records dropped beyond; a watcher behind
            them resyncs). Watchers also :meth:`trim` what they all read, so the log normally holds only
            what the slowest watcher has not sent yet; 1M keys is ~40 MB at most (Python ints in lists).
    """

    def __init__(self, max_keys: int = 1_000_000) -> None:
        self._max_keys = max_keys
        self._records: deque[ResidencyRecord] = deque()
        self._sizes: deque[int] = deque()
        self._keys = 0
        self.seq = 0
        """Sequence number of the last record (0: none yet)."""
        self._listeners: list[Callable[[], None]] = []

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest record kept (``seq + 1`` when none is)."""
        return self.seq - len(self._records) + 1

    def add_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` is called after every record (cheap: it should only set a flag)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    def record(
        self, endpoint_id: str, medium: str, added: Sequence[int] = (), removed: Sequence[int] = (), cleared: bool = False
    ) -> None:
        size = len(added) + len(removed) + 1
        self._records.append(ResidencyRecord(endpoint_id, medium, cleared, added, removed))
        self._sizes.append(size)
        self._keys += size
        self.seq += 1
        while self._keys > self._max_keys and len(self._records) > 1:
            self._records.popleft()
            self._keys -= self._sizes.popleft()
        for listener in self._listeners:
            listener()

    def since(self, seq: int, limit_keys: int = 65536) -> list[ResidencyRecord] | None:
        """Records after ``seq`` (at most about ``limit_keys`` keys' worth, at least one record);
        None when some of them were dropped (the caller resyncs)."""
        if seq >= self.seq:
            return []
        if seq + 1 < self.first_seq:
            return None
        start = seq + 1 - self.first_seq
        out: list[ResidencyRecord] = []
        keys = 0
        for record, size in zip(islice(self._records, start, None), islice(self._sizes, start, None), strict=True):
            out.append(record)
            keys += size
            if keys >= limit_keys:
                break
        return out

    def trim(self, seq: int) -> None:
        """Drop the records up to ``seq`` (every watcher has read them)."""
        while self._records and self.first_seq <= seq:
            self._records.popleft()
            self._keys -= self._sizes.popleft()

    def clear(self) -> None:
        """Drop every kept record (the sequence goes on): the last watcher left."""
        self._records.clear()
        self._sizes.clear()
        self._keys = 0
