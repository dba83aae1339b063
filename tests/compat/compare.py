"""Shape comparisons between two engines' answers to the compat script (vLLM fixture, live vLLM, simulator).

Every helper returns plain data (lists of differences, dicts of shapes) so a test can assert
equality and print what differs. Deliberate differences of the simulator are listed here, each
with its reason; anything else that differs fails the tests.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.hashing import external_hash_to_int, sha256_cbor_block_hashes

EPP_METRICS: dict[str, set[str]] = {
    "vllm:num_requests_waiting": {"engine", "model_name"},
    "vllm:num_requests_running": {"engine", "model_name"},
    "vllm:kv_cache_usage_perc": {"engine", "model_name"},
    "vllm:cache_config_info": {"block_size"},
}
"""What ``services/epp/datastore.py`` reads, with the labels it needs (at least these)."""

SIMULATOR_USAGE_DIFFERENCES = {
    "usage.completion_tokens_details",
    "usage.prompt_tokens_details.created_cache_tokens",
    "usage.prompt_tokens_details.multimodal_tokens",
}
"""Usage keys vLLM 0.32 sends (always null here) that the simulator leaves out; no kvmesh code reads them."""


def key_paths(value: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every key of a JSON object, in order (lists: their first element)."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else k
            out.append(path)
            out.extend(key_paths(v, path))
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        out.extend(key_paths(value[0], prefix + "[]"))
    return out


def usage_shape(response: dict[str, Any]) -> list[str]:
    return key_paths({"usage": response["usage"]})


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, bytes | bytearray) or (isinstance(value, dict) and set(value) == {"__bytes__"}):
        return "bytes"
    if value is None:
        return "null"
    if isinstance(value, list):
        inner = sorted({type_name(v) for v in value})
        return f"list[{'|'.join(inner)}]"
    return type(value).__name__


def event_shapes(events: list[dict[str, Any]]) -> dict[str, set[tuple[tuple[str, str], ...]]]:
    """Per event type, the set of (key, value type) sequences seen, key order kept."""
    shapes: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for e in events:
        shapes.setdefault(e["type"], set()).add(tuple((k, type_name(v)) for k, v in e.items()))
    return shapes


def event_counts(events: list[dict[str, Any]]) -> Counter[str]:
    """Blocks stored, blocks removed and clears in a list of events."""
    c: Counter[str] = Counter()
    for e in events:
        if e["type"] == "BlockStored":
            c["stored_blocks"] += len(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            c["removed_blocks"] += len(e["block_hashes"])
        else:
            c[e["type"]] += 1
    return c


def as_int_hash(h: Any) -> int:
    if isinstance(h, dict):
        h = bytes.fromhex(h["__bytes__"])
    return external_hash_to_int(h)


def prompt_hashes(token_ids: list[int], block: int) -> list[int]:
    """kvmesh's recomputation of the engine's hashes of a prompt's full blocks (uint64 form)."""
    return [external_hash_to_int(h) for h in sha256_cbor_block_hashes(token_ids, block)]


def stored_prompt_hashes(events: list[dict[str, Any]], token_ids: list[int], block: int) -> list[int]:
    """Which of the prompt's block hashes the events stored (in prompt order)."""
    stored = {as_int_hash(h) for e in events if e["type"] == "BlockStored" for h in e["block_hashes"]}
    return [h for h in prompt_hashes(token_ids, block) if h in stored]


def metric_families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """``vllm:*`` family name -> (type, label names of its samples other than le/quantile)."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:"):
            continue
        labels: set[str] = set()
        for s in fam.samples:
            labels |= set(s.labels) - {"le", "quantile"}
        out[fam.name] = (fam.type, frozenset(labels))
    return out


def epp_metric_problems(text: str) -> list[str]:
    fams = metric_families(text)
    problems = []
    for name, needed in EPP_METRICS.items():
        if name not in fams:
            problems.append(f"{name} missing")
        elif not needed <= fams[name][1]:
            problems.append(f"{name} labels {sorted(fams[name][1])} lack {sorted(needed - fams[name][1])}")
    return problems

