"""The simulator's KV events and /metrics against real vLLM 0.32 recordings (tests/compat/fixtures/vllm-0.32-cpu).

The events come from the simulator's own :class:`PrefixCache` (the code that runs in the engine),
encoded by the shared wire structs, with the recorded timestamp so bytes can be compared. The
recordings truncate ``raw_hex`` to 100 bytes for big messages: those compare by prefix, and every
message compares field by field through its ``decoded`` structure.
"""

import json
import re

import msgspec
import pytest

from engine_simulator.app import cache_config_info
from engine_simulator.config import SimulatorConfig
from engine_simulator.metrics import EngineMetrics
from engine_simulator.prefix_cache import PrefixCache
from kvmesh.kv_events import EventBatch, encode_batch
from tests.support import recording

EXPECTED_KEYS = {
    "BlockStored": [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ],
    "BlockRemoved": ["type", "block_hashes", "medium", "group_idx"],
    "AllBlocksCleared": ["type"],
}


def _lines(name: str) -> list[dict]:
    return [json.loads(line) for line in recording(name).read_text().splitlines()]


def _undecode(value):
    if isinstance(value, dict) and set(value) == {"__bytes__"}:
        return bytes.fromhex(value["__bytes__"])
    if isinstance(value, list):
        return [_undecode(v) for v in value]
    if isinstance(value, dict):
        return {k: _undecode(v) for k, v in value.items()}
    return value


def _replay(event: dict, block_size: int):
    """Make the simulator's PrefixCache emit the recorded event."""
    cache = PrefixCache(num_gpu_blocks=64, block_size=block_size)
    kind = event["type"]
    if kind == "BlockStored":
        n = len(event["block_hashes"])
        blocks = cache.allocate(n)
        cache.cache_full_blocks(blocks, event["block_hashes"], event["parent_block_hash"], event["token_ids"])
    elif kind == "BlockRemoved":
        (h,) = event["block_hashes"]
        blocks = cache.allocate(1)
        cache.cache_full_blocks(blocks, [h], None, [0] * block_size)
        cache.take_events()
        cache.free(blocks)
        cache.allocate(63)  # the whole pool: evicts it
    else:
        cache.reset()
    (out,) = cache.take_events()
    return out


@pytest.mark.parametrize("filename", ["kv_events_int_hashes.jsonl", "kv_events_bytes_hashes.jsonl"])
def test_events_match_recordings(filename: str) -> None:
    kinds = set()
    for rec in _lines(filename):
        ts, events, rank = _undecode(rec["decoded"])
        assert rec["nframes"] == 3 and rank == 0
        ours = [_replay(e, e.get("block_size", 32)) for e in events]
        payload = encode_batch(EventBatch(ts=ts, events=ours, data_parallel_rank=0))
        raw = bytes.fromhex(rec["raw_hex"])
        assert payload[: len(raw)] == raw, f"seq {rec['seq']}: bytes differ"
        decoded = msgspec.msgpack.decode(payload)
        assert decoded == [ts, events, 0]
        for event in decoded[1]:
            assert list(event) == EXPECTED_KEYS[event["type"]]
            kinds.add(event["type"])
    if filename == "kv_events_bytes_hashes.jsonl":
        assert kinds == set(EXPECTED_KEYS)


def test_all_blocks_cleared_payload_is_byte_exact() -> None:
    (rec,) = [
        r for r in _lines("kv_events_bytes_hashes.jsonl") if r["decoded"][1][0]["type"] == "AllBlocksCleared"
    ]
    ts = rec["decoded"][0]
    payload = encode_batch(
        EventBatch(ts=ts, events=[_replay({"type": "AllBlocksCleared"}, 32)], data_parallel_rank=0)
    )
    assert payload.hex() == rec["raw_hex"]


def test_int_hashes_are_uint64_on_the_wire() -> None:
    rec = _lines("kv_events_int_hashes.jsonl")[0]
    ts, (event,), _ = rec["decoded"]
    payload = encode_batch(EventBatch(ts=ts, events=[_replay(event, 32)], data_parallel_rank=0))
    assert payload[: len(bytes.fromhex(rec["raw_hex"]))] == bytes.fromhex(rec["raw_hex"])
    assert b"\xcf" in payload[:100]  # msgpack uint64 marker, as recorded


# -- /metrics -----------------------------------------------------------------------------
_FAMILY = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([^{\s]+)(?:\{(.*)\})? ")


def _families(text: str) -> dict[str, str]:
    return {m[1]: m[2] for line in text.splitlines() if (m := _FAMILY.match(line))}


def _label_names(text: str, sample: str) -> set[frozenset[str]]:
    out = set()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] == sample:
            out.add(frozenset(re.findall(r'(\w+)="', m[2] or "")))
    return out


def _buckets(text: str, family: str) -> list[str]:
    return [
        re.search(r'le="([^"]+)"', line)[1]
        for line in text.splitlines()
        if line.startswith(family + "_bucket{")
    ]


REQUIRED = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


@pytest.fixture(scope="module")
def exposition() -> tuple[str, str]:
    recorded = recording("metrics_exposition.txt").read_text()
    config = SimulatorConfig(model="tiny", block_size_tokens=32, num_gpu_blocks=16384, max_model_len=512)
    metrics = EngineMetrics("tiny", cache_config_info(config), 512)
    return recorded, metrics.exposition().decode()


def test_metric_families_types_and_labels_match_vllm(exposition: tuple[str, str]) -> None:
    recorded, ours = exposition
    rec_fam, our_fam = _families(recorded), _families(ours)
    for name in REQUIRED:
        assert name in our_fam, name
    sim_vllm = {n for n in our_fam if n.startswith("vllm:")}
    for name in sim_vllm:
        assert rec_fam.get(name) == our_fam[name], f"{name}: type {our_fam[name]} vs vLLM {rec_fam.get(name)}"
        sample = name + ("_count" if our_fam[name] == "histogram" else "")
        assert _label_names(ours, sample) == _label_names(recorded, sample), name


def test_cache_config_info_label_names_match(exposition: tuple[str, str]) -> None:
    recorded, ours = exposition
    assert _label_names(ours, "vllm:cache_config_info") == _label_names(recorded, "vllm:cache_config_info")
    line = next(x for x in ours.splitlines() if x.startswith("vllm:cache_config_info{"))
    for label in (
        'block_size="32"',
        'num_gpu_blocks="16384"',
        'enable_prefix_caching="True"',
        'prefix_caching_hash_algo="sha256_cbor"',
        'engine="0"',
    ):
        assert label in line


@pytest.mark.parametrize(
    "family",
    [
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:iteration_tokens_total",
        "vllm:request_time_per_output_token_seconds",
    ],
)
def test_histogram_buckets_match(exposition: tuple[str, str], family: str) -> None:
    recorded, ours = exposition
    assert _buckets(ours, family) == _buckets(recorded, family)
