"""Queue orderings: which queued request is dispatched next (``base.QueueOrdering``)."""

from services.flow_control.queues.base import QueuedItem, QueueOrdering
from services.flow_control.queues.fcfs import FcfsQueue

__all__ = ["FcfsQueue", "QueueOrdering", "QueuedItem"]
