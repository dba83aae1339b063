"""The fairness policies, registered by name in :mod:`services.flow_control.policies`.

* ``global-strict-fairness-policy`` (GIE's default): no isolation, the band is one FCFS order:
  the flow whose head request arrived first. O(flows) per pick.
* ``round-robin-fairness-policy``: one dispatch per backlogged flow in turn (GIE's round robin);
  an insertion-ordered dict, the served flow moves to the back: O(1) per pick.
* ``least-attained-service-fairness-policy``: token-weighted least attained service, the
  Virtual Token Counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024),
  which GIE ships as ``vtc-fairness-policy`` charging bytes at pick. Here each flow's counter
  counts the tokens it was actually served: ``w_prompt * prompt_tokens`` when a request is
  dispatched (its prefill), corrected to the engine's real prompt count and
  ``+ w_output * completion_tokens`` when the request ends, all divided by the flow's weight.
  The backlogged, eligible flow with the smallest counter goes next. A flow that becomes
  backlogged is lifted to the smallest counter of the other backlogged flows (VTC's rule, so an idle
  tenant banks no credit). O(flows) per pick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from services.flow_control.fairness.base import FairnessPolicy

if TYPE_CHECKING:
    from services.flow_control.bands import Band, FlowQueue
    from services.flow_control.queues.base import QueuedItem

GLOBAL_STRICT = "global-strict-fairness-policy"
ROUND_ROBIN = "round-robin-fairness-policy"
LEAST_ATTAINED_SERVICE = "least-attained-service-fairness-policy"


class GlobalStrictFairness(FairnessPolicy):
    type_name = GLOBAL_STRICT

    def pick(self, band: Band, eligible: Callable[[FlowQueue], bool]) -> FlowQueue | None:
        best: FlowQueue | None = None
        best_key = (float("inf"), 0)
        for flow in band.backlogged.values():
            head = flow.queue.peek()
            if head is None or not eligible(flow):
                continue
            key = (head.enqueued_at, head.ticket_id)
            if key < best_key:
                best, best_key = flow, key
        return best


class RoundRobinFairness(FairnessPolicy):
    type_name = ROUND_ROBIN

    def __init__(self) -> None:
        self._order: dict[str, FlowQueue] = {}

    def on_backlogged(self, band: Band, flow: FlowQueue) -> None:
        self._order[flow.flow_id] = flow

    def on_idle(self, band: Band, flow: FlowQueue) -> None:
        self._order.pop(flow.flow_id, None)

    def pick(self, band: Band, eligible: Callable[[FlowQueue], bool]) -> FlowQueue | None:
        for flow_id, flow in self._order.items():
            if eligible(flow):
                del self._order[flow_id]  # to the back of the turn order
                self._order[flow_id] = flow
                return flow
        return None


class LeastAttainedServiceFairness(FairnessPolicy):
    """Token-weighted least attained service (see the module docstring).

    Args:
        weights: flow id -> weight (> 0); a weight-2 flow gets twice the tokens of a weight-1 one.
        default_weight: weight of unlisted flows.
        prompt_weight, output_weight: cost of one prompt (prefill) and one output (decode) token;
            the VTC paper's ``w_p = 1, w_q = 2`` is the default.
    """

    type_name = LEAST_ATTAINED_SERVICE

    def __init__(
        self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0,
        prompt_weight: float = 1.0, output_weight: float = 2.0,
    ) -> None:
        self.weights = dict(weights or {})
        for flow_id, weight in self.weights.items():
            if not weight > 0:
                raise ValueError(f"fairness weight of flow {flow_id!r} must be > 0, got {weight}")
        if not default_weight > 0:
            raise ValueError(f"default fairness weight must be > 0, got {default_weight}")
        self.default_weight = default_weight
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}

    def _weight(self, flow_id: str) -> float:
        return self.weights.get(flow_id, self.default_weight)

    def on_backlogged(self, band: Band, flow: FlowQueue) -> None:
        others = [self.counters.get(f, 0.0) for f in band.backlogged if f != flow.flow_id]
        floor = min(others) if others else 0.0
        self.counters[flow.flow_id] = max(self.counters.get(flow.flow_id, floor), floor)

    def on_forget(self, band: Band, flow: FlowQueue) -> None:
        self.counters.pop(flow.flow_id, None)

    def pick(self, band: Band, eligible: Callable[[FlowQueue], bool]) -> FlowQueue | None:
        best: FlowQueue | None = None
        best_key = (float("inf"), float("inf"))
        counters = self.counters
        for flow in band.backlogged.values():
            if not eligible(flow):
                continue
            head = flow.queue.peek()
            key = (counters.get(flow.flow_id, 0.0), head.enqueued_at if head else 0.0)
            if key < best_key:
                best, best_key = flow, key
        return best

    def on_dispatch(self, band: Band, flow: FlowQueue, item: QueuedItem) -> None:
        cost = self.prompt_weight * item.request.prompt_tokens / self._weight(flow.flow_id)
        self.counters[flow.flow_id] = self.counters.get(flow.flow_id, 0.0) + cost

    def on_served(self, band: Band, flow_id: str, item: QueuedItem, prompt_tokens: int, completion_tokens: int) -> None:
        if flow_id not in self.counters:
            return  # forgotten meanwhile
        correction = self.prompt_weight * (prompt_tokens - item.request.prompt_tokens) if prompt_tokens else 0.0
        cost = correction + self.output_weight * completion_tokens
        self.counters[flow_id] += cost / self._weight(flow_id)
