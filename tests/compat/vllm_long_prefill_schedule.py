"""Drive vLLM 0.32's own v1 ``Scheduler`` in process and print each step's scheduled tokens (run by vLLM's venv).

Used by ``tests/compat/test_vllm_long_prefill.py`` to hold the simulator's ``long_prefill_token_threshold``
to vLLM's: no model runs and nothing is downloaded; the ``ModelConfig`` reads the tiny model's ``config.json``
(``make model``) and the scheduler is built on a hand-made single-group KV cache config, the way vLLM's own
scheduler tests build one. Each step every request whose prefill completes (and every decode) is handed one
sampled token (id 100), as a model runner would.

stdin: JSON ``{"model_dir", "scenarios": [scenario, ...]}``, a scenario being ``{"block_size", "num_blocks",
"max_num_seqs", "max_num_batched_tokens", "max_model_len", "long_prefill_token_threshold",
"long_prefill_token_threshold_adaptive", "scheduler_reserve_full_isl", "requests": [[arrival_step, request_id, prompt_token_ids, max_tokens],
...], "steps"}``. stdout (last line): JSON ``{"vllm_version", "results": [[[[request_id, tokens], ...], ...], ...]}``:
per scenario, per step, running (and resumed) requests first, then new ones.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(model_dir: str, scenario: dict[str, Any]) -> list[list[tuple[str, int]]]:
    """One scenario on a fresh vLLM ``Scheduler``: each step's ``(request_id, tokens)``."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
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
    config = VllmConfig(model_config=model, scheduler_config=sched,
                        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True))
    config.cache_config.num_gpu_blocks = scenario["num_blocks"]
    kv = KVCacheConfig(num_blocks=scenario["num_blocks"], kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=16,
                                                        dtype=torch.float32))])
    scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=bs)
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(bs, hash_fn)
    pending = sorted(scenario["requests"], key=lambda r: r[0])
    steps: list[list[tuple[str, int]]] = []
    for step in range(scenario["steps"]):
        while pending and pending[0][0] <= step:
            _, rid, prompt, max_tokens = pending.pop(0)
            scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                          None, arrival_time=float(step), block_hasher=hasher))
        out = scheduler.schedule()
        order = list(out.scheduled_cached_reqs.req_ids) + [r.req_id for r in out.scheduled_new_reqs]
        steps.append([(rid, out.num_scheduled_tokens[rid]) for rid in order])
        sampled = []
        for rid in order:
            req = scheduler.requests[rid]
            sampled.append([100] if req.num_computed_tokens >= req.num_tokens else [])
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=order, req_id_to_index={r: i for i, r in enumerate(order)}, sampled_token_ids=sampled))
    return steps


def main() -> int:
    import vllm

    doc = json.load(sys.stdin)
    results = [run(doc["model_dir"], scenario) for scenario in doc["scenarios"]]
    print(json.dumps({"vllm_version": vllm.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
