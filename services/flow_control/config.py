"""FlowControlConfig: every knob of the flow_control service (flags > env > file > defaults)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from kvmesh.config import GrpcServiceConfig
from services.flow_control.controller import ControllerLimits


class FlowControlConfig(GrpcServiceConfig):
    """Admission control: FCFS queue, global in-flight limit, queue TTL."""

    model_config = SettingsConfigDict(env_prefix="KVMESH_FLOW_CONTROL_")

    max_in_flight: int = Field(256, ge=1, le=1_000_000)
    """Requests dispatched and not yet released, across all flows; the next ones queue."""
    queue_ttl_seconds: float = Field(30.0, gt=0, le=3600)
    """How long a request may wait in the queue before it is evicted (EVICTED_TTL)."""
    max_queue_size: int = Field(10_000, ge=0, le=10_000_000)
    """Requests that may wait at once; more are rejected (REJECTED_CAPACITY). 0 disables queueing."""

    def limits(self) -> ControllerLimits:
        return ControllerLimits(
            max_in_flight=self.max_in_flight,
            queue_ttl_seconds=self.queue_ttl_seconds,
            max_queue_size=self.max_queue_size,
        )
