"""Record SGLang 0.5.23 KV-event payloads with SGLang's own code (its structs and its recorder).

SGLang does not run on this machine's CPU (``docs/engines.md``), so nothing here runs an engine.
Instead the two modules that produce the wire bytes are loaded from the released wheel and driven
the way its radix cache drives them:

* ``sglang/srt/disaggregation/kv_events.py``: ``BlockStored``/``BlockRemoved``/``AllBlocksCleared``,
  ``KVEventBatch`` and the msgspec encoding (loaded with its two runtime-only imports stubbed:
  ``sglang.srt.runtime_context.get_parallel`` and ``sglang.srt.utils.network.NetworkAddress``);
* ``sglang/srt/mem_cache/events.py``: ``KVCacheEventRecorder`` (one ``BlockStored`` per page,
  coalesced into chains, parent links, LoRA names, ``cache_salt``, media), fed by radix nodes shaped
  as SGLang's ``TreeNode`` (``key.token_ids``, ``key.extra_key``, ``key.cache_salt``, ``parent``,
  ``hash_value``). Its hash helpers (``sglang.srt.mem_cache.utils``, which import CUDA kernels) are
  replaced by a pure-Python SHA-256 page chain with SGLang's ``hash_str_to_int64``; hashes are opaque
  to kvmesh, which keys blocks by token ids.

Usage (``pip download sglang==0.5.23 --no-deps`` and unzip it first)::

    .venv/bin/python tests/compat/record_sglang.py /tmp/sglang-wheel tests/compat/fixtures/sglang-0.5.23/kv_events.jsonl

Each output line: ``seq``, ``raw_hex`` (the whole payload), ``scenario`` and ``decoded`` (for reading).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

PAGE = 4


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _stub(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def load_sglang(wheel_dir: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """SGLang's ``kv_events`` and ``mem_cache.events`` modules, loaded from an unpacked wheel."""
    for pkg in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation", "sglang.srt.mem_cache"):
        _stub(pkg, __path__=[])
    _stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    _stub("sglang.srt.utils.network", NetworkAddress=object)

    def hash_str_to_int64(hash_str: str) -> int:  # as sglang/srt/mem_cache/utils.py
        value = int(hash_str[:16], 16)
        return value - 2**64 if value >= 2**63 else value

    def page_hashes(node: Any, page_size: int, prior: str | None) -> list[str]:
        out = []
        tokens = node.key.token_ids
        for start in range(0, len(tokens), page_size):
            digest = hashlib.sha256((prior or "").encode() + repr(tokens[start : start + page_size]).encode())
            prior = digest.hexdigest()
            out.append(prior)
        return out

    def compute_node_hash_values(node: Any, page_size: int) -> list[str]:
        parent = node.parent.hash_value[-1] if node.parent is not None and node.parent.hash_value else None
        return page_hashes(node, page_size, parent)

    def compute_node_event_hash_values(node: Any, page_size: int) -> list[str]:
        if node.event_hash_value is None:
            parent = node.parent.event_hash_value[-1] if node.parent and node.parent.event_hash_value else None
            seed = hashlib.sha256(f"{node.key.extra_key}|{node.key.cache_salt}".encode()).hexdigest()
            node.event_hash_value = page_hashes(node, page_size, parent or seed)
        return node.event_hash_value

    _stub(
        "sglang.srt.mem_cache.utils",
        compute_node_hash_values=compute_node_hash_values,
        compute_node_event_hash_values=compute_node_event_hash_values,
        hash_str_to_int64=hash_str_to_int64,
    )
    src = wheel_dir / "sglang" / "srt"
    kv_events = _load("sglang.srt.disaggregation.kv_events", src / "disaggregation" / "kv_events.py")
    recorder = _load("sglang.srt.mem_cache.events", src / "mem_cache" / "events.py")
    return kv_events, recorder


class _Key:
    def __init__(self, token_ids: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.token_ids = token_ids
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.is_bigram = False

    def __len__(self) -> int:
        return len(self.token_ids)


class _Node:
    """The fields of SGLang's radix ``TreeNode`` the recorder reads."""

    def __init__(self, parent: _Node | None, tokens: list[int], extra_key: str | None = None,
                 cache_salt: str | None = None) -> None:
        self.parent = parent
        self.key = _Key(tokens, extra_key, cache_salt)
        self.hash_value: list[str] | None = [] if parent is None else None
        self.event_hash_value: list[str] | None = [] if parent is None else None


def prompt(seed: int, pages: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 2000 + 3 for i in range(pages * PAGE)]


def record(wheel_dir: Path) -> list[dict[str, Any]]:
    kv_events, events = load_sglang(wheel_dir)
    lora_id = "0123456789abcdef0123456789abcdef"  # a LoRARef.lora_id (uuid hex, 32 chars)
    names = events.KvEventLoraNames()
    names.register(lora_id=lora_id, lora_name="sql-adapter")  # adapter load
    names.register(types.SimpleNamespace(extra_key=lora_id, lora_id=lora_id), "sql-adapter")  # request admission
    rec = events.KVCacheEventRecorder(enabled=True, page_size=PAGE, lora_names=names)
    root = _Node(None, [])
    shared = prompt(1, 3)
    lines: list[dict[str, Any]] = []

    def flush(scenario: str, rank: int = 0) -> None:
        batch = kv_events.KVEventBatch(ts=1_700_000_000.0 + len(lines), events=rec.take(), attn_dp_rank=rank)
        payload = kv_events.msgspec.msgpack.encode(batch)
        lines.append({
            "seq": len(lines),
            "scenario": scenario,
            "raw_hex": payload.hex(),
            "decoded": kv_events.msgspec.to_builtins(kv_events.msgspec.msgpack.decode(payload)),
        })

    # 1. a prompt of 3 pages, then a branch of 2 more pages under it (a child radix node)
    a = _Node(root, shared)
    rec.record_store(a)
    b = _Node(a, prompt(2, 2))
    rec.record_store(b)
    flush("store_chain")
    # 2. the same tokens under a cache_salt (tenant "t1") and under a LoRA adapter
    salted = _Node(root, shared, cache_salt="t1")
    rec.record_store(salted)
    flush("store_salted")
    lora = _Node(root, shared, extra_key=lora_id)
    rec.record_store(lora)
    flush("store_lora")
    # 3. HiCache: the branch is backed up to host memory, then evicted from the GPU
    rec.record_store(b, medium=kv_events.StorageMedium.CPU)
    rec.record_remove(b)
    flush("move_to_host")
    # 4. the host copy is dropped too; a second attention-DP rank stores the prompt
    rec.record_remove(b, medium=kv_events.StorageMedium.CPU)
    flush("remove_host")
    rec.record_store(_Node(root, shared))
    flush("store_rank1", rank=1)
    # 5. /flush_cache
    rec.record_all_cleared()
    flush("all_cleared")
    return lines


def main() -> None:
    wheel_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    lines = record(wheel_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"wrote {len(lines)} messages to {out}")


if __name__ == "__main__":
    main()
