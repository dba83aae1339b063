"""The async engine loop: drives :class:`EngineCore` in model time and fans out results.

One task runs the loop: schedule a step, wait its modelled duration on the injected
:class:`kvmesh.clock.Clock` (``ScaledClock`` for ``--time-scale``, ``ManualClock`` offline),
apply it, publish the step's KV events (one ZMQ message per step, like vLLM's engine core), record
metrics and hand each request its new tokens through an ``asyncio.Queue``. With no work it waits on
an event; a ``reset_prefix_cache`` therefore publishes ``AllBlocksCleared`` only at the next step, as
vLLM does.

Model time is kept on a schedule, not re-read at each step: while the engine has work, a step starts
where the previous one was modelled to end, and the loop sleeps until the step's modelled end. When
the host starves the process (Python overhead, other processes on the same cores: the simulator's
model time then runs behind the wall clock), the steps behind schedule run back to back until the
engine is on schedule again, so a late wake-up delays tokens but does not cost the engine throughput
(a GPU does not slow down because its host's CPU was busy). The debt is bounded by
:data:`MAX_CATCH_UP_SECONDS`; what exceeds it is given up and counted in
``kvmesh_sim_step_lost_seconds_total``, and ``kvmesh_sim_step_lag_seconds`` is the current lag
(issue 9: at ``--time-scale 2`` on a loaded 2-core host, engines that re-read the clock each step ran
38-57 % of their model time late, and the policy whose run met more load lost throughput for it).

A failing step (an exception out of the core's ``schedule``/``update``, the publisher or the metrics: a bug,
a request in a state it should not reach) kills the engine as vLLM 0.32's engine core dies: the failure is
logged once with its traceback, every in-flight request ends at once with an error output
(:attr:`RequestOutput.error`: the HTTP layer answers 500 / streams the error event and ``[DONE]``),
:attr:`AsyncEngine.dead` is set (``/health`` 503) and every later :meth:`AsyncEngine.submit` raises
:class:`EngineDeadError` (500). Before, the loop task died silently and every request hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from engine_simulator.latency_model import LatencyModel
from engine_simulator.metrics import EngineMetrics
from engine_simulator.publisher import EventPublisher
from engine_simulator.scheduler import EngineCore, Request, RequestOutput
from kvmesh.clock import Clock

logger = logging.getLogger(__name__)

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
"""vLLM 0.32's ``EngineDeadError`` message (``vllm/v1/engine/exceptions.py``), the 500's and the stream's error."""

MAX_CATCH_UP_SECONDS = 5.0
"""Most model seconds a busy engine may run behind its schedule and still catch up (module docstring)."""


class EngineDeadError(RuntimeError):
    """The engine loop died on an exception (vLLM's ``EngineDeadError``): the request cannot run (HTTP 500)."""

    def __init__(self, message: str = ENGINE_DEAD_MESSAGE) -> None:
        super().__init__(message)


class AsyncEngine:
    """Async front of the engine core.

    Args:
        core: the pure engine core.
        latency: step-time model.
        clock: model-time clock.
        publisher: KV-event publisher (the null one when disabled).
        metrics: the engine's metric families (None in pure tests).
    """

    def __init__(
        self,
        core: EngineCore,
        latency: LatencyModel,
        clock: Clock,
        publisher: EventPublisher,
        metrics: EngineMetrics | None = None,
    ) -> None:
        self.core = core
        self.latency = latency
        self.clock = clock
        self.publisher = publisher
        self.metrics = metrics
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._requests: dict[str, Request] = {}
        """The request behind each queue (its error output when the loop dies)."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.num_steps = 0
        self.dead: BaseException | None = None
        """The exception that killed the loop (None while it runs): ``/health`` 503, :meth:`submit` refused."""

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        """Abort everything and stop the loop."""
        for rid in list(self._queues):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- requests ----------------------------------------------------------------------
    def submit(self, request: Request) -> asyncio.Queue[RequestOutput]:
        """Queue a request; its outputs arrive on the returned queue (the last has ``finished``).

        Raises:
            ValueError: from :meth:`EngineCore.add_request` (bad request).
            EngineDeadError: the loop died (:attr:`dead`).
        """
        if self.dead is not None:
            raise EngineDeadError()
        request.arrival_time = self.clock.now()
        self.core.add_request(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._requests[request.request_id] = request
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Client gone: free the request's slot and blocks (no-op when already finished)."""
        self._queues.pop(request_id, None)
        self._requests.pop(request_id, None)
        if self.dead is not None:  # the core's state is unknown after the failure: leave it alone
            return
        req = self.core.abort_request(request_id)
        if req is not None:
            logger.debug("aborted request_id=%s", request_id)
            self._record_finished(req, self.clock.now())
            self._record_step(0, 0, 0)
            self._wake.set()

    def wake(self) -> None:
        """Make an idle loop look at its queues again (the offload connector answered a kv_store lookup)."""
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        ok = self.core.reset_prefix_cache()
        if not ok:
            logger.warning("reset_prefix_cache refused: blocks are still in use")
        return ok

    # -- the loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:  # any step failure kills the engine (module docstring)
            self._die(exc)

    def _die(self, exc: Exception) -> None:
        """The loop failed: log it with its traceback, end every in-flight request with an error output."""
        self.dead = exc
        failed = list(self._queues.items())
        logger.error("engine core failed: %d in-flight request(s) end with an error; /health answers 503 from now "
                     "on (restart the engine)", len(failed), exc_info=exc)
        for rid, queue in failed:
            req = self._requests.get(rid)
            if req is not None:
                queue.put_nowait(RequestOutput(req, [], True, error=ENGINE_DEAD_MESSAGE))
        self._queues.clear()
        self._requests.clear()

    async def _loop(self) -> None:
        core, clock, latency = self.core, self.clock, self.latency
        scheduled_end: float | None = None  # modelled end of the last step while busy; None after idling
        while True:
            if not core.has_work():
                scheduled_end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = clock.now()
            t0 = now if scheduled_end is None else max(scheduled_end, now - MAX_CATCH_UP_SECONDS)
            if scheduled_end is not None and t0 > scheduled_end and self.metrics is not None:
                self.metrics.record_lost_time(t0 - scheduled_end)
            q0, h0, p0 = core.prefix_queries_tokens, core.prefix_hits_tokens, core.num_preemptions
            eq0, eh0 = core.external_queries_tokens, core.external_hits_tokens
            step = core.schedule(t0)
            if self.metrics is not None and core.prefix_queries_tokens != q0:
                self.metrics.record_scheduled(
                    prompt_tokens=core.prefix_queries_tokens - q0, cached_tokens=core.prefix_hits_tokens - h0,
                    external_queries=core.external_queries_tokens - eq0, external_hits=core.external_hits_tokens - eh0,
                )
            if step.empty:
                # nothing fits (e.g. every block is held by preempted work); wait for a change
                self._publish()
                self._record_step(0, core.num_preemptions - p0, 0)
                scheduled_end = None  # waiting is not running late
                ready = core.next_load_ready()  # offload loads in flight (engine_simulator/offload.py)
                if ready is not None:
                    await clock.sleep(max(ready - clock.now(), 0.0))
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            dt = latency.step_seconds(step.prefill_tokens, step.decode_seqs, step.decode_context_tokens)
            scheduled_end = t0 + dt
            remaining = scheduled_end - clock.now()
            if remaining > 0:
                await clock.sleep(remaining)
            else:
                await asyncio.sleep(0)  # behind schedule: catch up, but let the server answer meanwhile
            now = clock.now()
            outputs = core.update(step)
            self.num_steps += 1
            self._publish()
            for out in outputs:
                self._deliver(out, now)
            self._record_step(step.prefill_tokens + step.decode_seqs, core.num_preemptions - p0, len(outputs))
            if self.metrics is not None:
                self.metrics.record_step_time(model_seconds=dt, lag_seconds=clock.now() - scheduled_end)

    def _publish(self) -> None:
        events = self.core.cache.take_events()
        if events:
            self.publisher.publish(events)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        req = out.request
        metrics = self.metrics
        if req.first_token_time is None:
            req.first_token_time = now
            if metrics is not None:
                metrics.record_first_token(ttft_seconds=now - req.arrival_time)
        elif metrics is not None and req.last_token_time is not None:
            metrics.record_token(itl_seconds=now - req.last_token_time)
        req.last_token_time = now
        if out.finished:
            self._record_finished(req, now)
        queue = self._queues.get(req.request_id)
        if queue is not None:
            queue.put_nowait(out)
            if out.finished:
                del self._queues[req.request_id]
                self._requests.pop(req.request_id, None)

    def _record_step(self, step_tokens: int, preemptions: int, generated: int) -> None:
        if self.metrics is not None:
            core = self.core
            self.metrics.record_step(
                running=core.num_running,
                waiting=core.num_waiting,
                deferred=core.num_deferred,
                usage=core.cache.usage,
                step_tokens=step_tokens,
                new_preemptions=preemptions,
                new_generation_tokens=generated,
            )

    def _record_finished(self, req: Request, now: float) -> None:
        if self.metrics is None or req.finish_reason is None:
            return
        scheduled = req.first_scheduled_time if req.first_scheduled_time is not None else now
        first = req.first_token_time if req.first_token_time is not None else now
        self.metrics.record_finished(
            finish_reason=str(req.finish_reason),
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.num_cached_tokens,
            generation_tokens=len(req.output_token_ids),
            e2e_seconds=now - req.arrival_time,
            queue_seconds=scheduled - req.arrival_time,
            prefill_seconds=first - scheduled,
            decode_seconds=now - first,
        )
