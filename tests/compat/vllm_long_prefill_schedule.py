"""Drive vLLM 0.32's own v1 ``Scheduler`` in process and print each step's scheduled tokens (run by vLLM's venv).

Used by ``tests/compat/test_vllm_long_prefill.py`` to hold the simulator's ``long_prefill_token_threshold``
to vLLM's: no model runs and nothing is downloaded; the ``ModelConfig`` reads the tiny model's ``config.json``
(``make model``) and the scheduler is built on a hand-made single-group KV cache config, the way vLLM's own
scheduler tests build one. Each step every request whose prefill completes (and every decode) is handed one
sampled token (id 100), as a model runner would.

A scenario with ``"offloaded"`` (token prefixes whose full blocks sit in an offloaded tier) and ``"load_steps"``
gets a KV connector, :class:`ScriptedOffloadConnector` (loaded by vLLM's ``KVConnectorFactory`` through
``kv_connector_module_path``): it answers ``get_num_new_matched_tokens`` as vLLM's OffloadingConnector does (the
full blocks right after the local hit, up to ``(num_tokens - 1) // block_size``, loaded asynchronously), and the
driver reports a load started in step ``s`` as received (``KVConnectorOutput.finished_recving``) with the output
of step ``s + load_steps - 1``, so the request is promoted in step ``s + load_steps``. No KV moves: only the
scheduler's admission of loads (``load_kv_async``, ``reserved_blocks``, ``kv_holding_waiting``) is exercised.

stdin: JSON ``{"model_dir", "scenarios": [scenario, ...]}``, a scenario being ``{"block_size", "num_blocks",
"max_num_seqs", "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold",
"long_prefill_token_threshold_adaptive", "scheduler_reserve_full_isl", "requests": [[arrival_step, request_id, prompt_token_ids, max_tokens],
...], "steps"[, "offloaded": [[token, ...], ...], "load_steps"]}``. stdout (last line): JSON ``{"vllm_version", "results": [[[[request_id, tokens], ...], ...], ...],
"counts": [[[running, waiting, deferred], ...], ...]}``: per scenario, per step, the scheduled requests (running and
resumed ones first, then new ones) and the ``SchedulerStats`` vLLM's engine core hands its stat loggers after that
step's ``update_from_output`` (``num_running_reqs``, ``num_waiting_reqs + num_skipped_waiting_reqs``, which is
``vllm:num_requests_waiting``, and ``num_skipped_waiting_reqs``, its ``reason="deferred"`` part).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _connector_class() -> type:
    """vLLM's ``KVConnectorBase_V1`` subclass, built on first use so this module imports without vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    class ScriptedOffloadConnector(KVConnectorBase_V1):
        """Scheduler side of an offload connector whose tier holds ``kv_connector_extra_config["offloaded"]``."""

        def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config, role, kv_cache_config)
            extra = vllm_config.kv_transfer_config.kv_connector_extra_config
            self.block_size = int(extra["block_size"])
            self.stored = {tuple(p[: k * self.block_size]) for p in extra["offloaded"]
                           for k in range(1, len(p) // self.block_size + 1)}
            self.started: list[str] = []  # requests whose load started since the driver last looked
            self.hits: dict[str, list[tuple[int, ...]]] = {}  # request -> the blocks of its last lookup's hit
            self.loading: dict[str, list[tuple[int, ...]]] = {}  # request -> the blocks its load in flight carries

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            tokens, bs = list(request.all_token_ids), self.block_size
            first, n = num_computed_tokens // bs, 0
            while first + n < (request.num_tokens - 1) // bs and tuple(tokens[: (first + n + 1) * bs]) in self.stored:
                n += 1
            hit = [tuple(tokens[: (first + k + 1) * bs]) for k in range(n)]
            # vLLM 0.32's OffloadingConnector (offloading/scheduler.py, _chunks_being_loaded): a request whose hit
            # blocks another request is loading is delayed (None), and gets them from the GPU once loaded
            being_loaded = {key for keys in self.loading.values() for key in keys}
            if any(key in being_loaded for key in hit):
                return None, False
            self.hits[request.request_id] = hit
            return n * bs, n > 0

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens > 0:
                self.started.append(request.request_id)
                self.loading[request.request_id] = self.hits.get(request.request_id, [])

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            return KVConnectorMetadata()

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            pass

        def wait_for_layer_load(self, layer_name: str) -> None:
            pass

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            pass

        def wait_for_save(self) -> None:
            pass

    return ScriptedOffloadConnector


def __getattr__(name: str) -> Any:  # PEP 562: how KVConnectorFactory finds the class
    if name == "ScriptedOffloadConnector":
        return _connector_class()
    raise AttributeError(name)


def run(model_dir: str, scenario: dict[str, Any]) -> tuple[list[list[tuple[str, int]]], list[list[int]]]:
    """One scenario on a fresh vLLM ``Scheduler`` (``log_stats=True``): each step's ``(request_id, tokens)`` and its
    ``[running, waiting, deferred]`` counts after the step."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    bs, max_len = scenario["block_size"], scenario["max_model_len"]
    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=max_len, skip_tokenizer_init=True)
    sched = SchedulerConfig(
        max_num_seqs=scenario["max_num_seqs"], max_num_batched_tokens=scenario["max_num_batched_tokens"],
        max_model_len=max_len, is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=scenario["long_prefill_token_threshold"],
        long_prefill_token_threshold_adaptive=scenario["long_prefill_token_threshold_adaptive"],
        scheduler_reserve_full_isl=scenario["scheduler_reserve_full_isl"],
    )
    transfer = None
    if "offloaded" in scenario:
        transfer = KVTransferConfig(kv_connector="ScriptedOffloadConnector", kv_role="kv_both",
                                    kv_connector_module_path="vllm_long_prefill_schedule",
                                    kv_connector_extra_config={"offloaded": scenario["offloaded"], "block_size": bs})
    config = VllmConfig(model_config=model, scheduler_config=sched, kv_transfer_config=transfer,
                        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True))
    config.cache_config.num_gpu_blocks = scenario["num_blocks"]
    kv = KVCacheConfig(num_blocks=scenario["num_blocks"], kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16,
                                                        dtype=torch.float32))])
    scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=bs, log_stats=True)
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    pending = sorted(scenario["requests"], key=lambda r: r[0])
    steps: list[list[tuple[str, int]]] = []
    counts: list[list[int]] = []
    load_done: dict[int, set[str]] = {}  # step -> loads reported received with that step's output
    for step in range(scenario["steps"]):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          None, arrival_time=float(step), block_hasher=hasher))
        out = scheduler.schedule()
        if scheduler.connector is not None:
            for rid in scheduler.connector.started:
                load_done.setdefault(step + scenario["load_steps"] - 1, set()).add(rid)
            scheduler.connector.started.clear()
        order = list(out.scheduled_cached_reqs.req_ids) + [r.req_id for r in out.scheduled_new_reqs]
        steps.append([(rid, out.num_scheduled_tokens[rid]) for rid in order])
        sampled = []
        for rid in order:
            req = scheduler.requests[rid]
            sampled.append([100] if req.num_computed_tokens >= req.num_tokens else [])
        done = load_done.pop(step, None)
        if done and scheduler.connector is not None:
            for rid in done:  # the load's blocks are no longer being loaded
                scheduler.connector.loading.pop(rid, None)
        outputs = scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=done) if done else None))
        stats = next(eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats is not None)
        counts.append([stats.num_running_reqs, stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
                       stats.num_skipped_waiting_reqs])
    return steps, counts


def main() -> int:
    import vllm

    doc = json.load(sys.stdin)
    runs = [run(doc["model_dir"], scenario) for scenario in doc["scenarios"]]
    print(json.dumps({"vllm_version": vllm.__version__, "results": [steps for steps, _ in runs],
                      "counts": [counts for _, counts in runs]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
