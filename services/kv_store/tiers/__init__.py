"""Storage tiers behind the ``StoreTier`` protocol (``base.py``); one file per medium."""

from services.kv_store.tiers.base import PutResult, StoreTier, TierStats
from services.kv_store.tiers.cpu import CpuTier

__all__ = ["CpuTier", "PutResult", "StoreTier", "TierStats"]
