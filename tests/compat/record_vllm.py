"""Record real vLLM's answers to the compat script as fixtures (``tests/compat/fixtures/vllm-<version>/``).

Starts one vLLM server from ``.venv-vllm`` on the tiny model (``make vllm-env model``) with the
script's cache shape (32-token blocks, ``--num-gpu-blocks-override 24``, ``max_model_len`` 512,
``VLLM_SERVER_DEV_MODE=1``, ``--enable-scale-out`` for the render endpoints), binds a ZMQ SUB where
its KV events go, runs :data:`tests.compat.script.STEPS`, and writes:

| file | what |
| --- | --- |
| ``script.json`` | per step: request, response body, prompt token ids, ``/tokenize`` body, KV-event messages |
| ``metrics.txt`` | ``GET /metrics`` after the script |
| ``models.json``, ``render.json``, ``chat_render.json``, ``tokenize_chat.json`` | other wire shapes |
| ``meta.json`` | vLLM version, command line, time to ``/health`` |

Bytes in event payloads are written as ``{"__bytes__": hex}``; maps keep the engine's key order.
Run: ``.venv/bin/python -m tests.compat.record_vllm [--out DIR]`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvmesh_cli.launcher import ManagedProcess, free_port
from kvmesh_cli.vllm_engine import VllmEngineSpec, vllm_missing_reason
from tests.compat.script import BLOCK, MAX_MODEL_LEN, MODEL, NUM_GPU_BLOCKS, EventSink, run_script
from tests.support import WaitTimeout, wait_until

VLLM_VERSION = "0.32.0"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / f"vllm-{VLLM_VERSION}"


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": bytes(value).hex()}
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def start_vllm(run_dir: Path, events_endpoint: str, **overrides: Any) -> tuple[ManagedProcess, VllmEngineSpec, float]:
    """Start one vLLM with the script's cache shape; returns it, its spec and seconds to /health.

    Raises:
        RuntimeError: when it exits or does not answer /health within 240 s (with its log tail).
    """
    kwargs: dict[str, Any] = {
        "port": free_port(), "run_dir": run_dir, "events_endpoint": events_endpoint, "model": MODEL,
        "block_size_tokens": BLOCK, "max_model_len": MAX_MODEL_LEN, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
        "dev_mode": True, "extra_args": ("--enable-scale-out",),
    }
    kwargs.update(overrides)
    spec = VllmEngineSpec(**kwargs)
    proc = ManagedProcess(f"vllm-{spec.port}", spec.argv(), run_dir / f"vllm-{spec.port}.log", env=spec.env(),
                          die_with_parent=True)
    t0 = time.monotonic()
    proc.start()

    def healthy() -> bool:
        if not proc.alive():
            raise RuntimeError(f"vLLM exited:\n{proc.log_tail(60)}")
        return httpx.get(f"{spec.url}/health", timeout=1.0).status_code == 200

    try:
        wait_until(healthy, 240, "vLLM /health 200", interval=0.25, ignore=(httpx.HTTPError,))
    except WaitTimeout as exc:
        proc.stop()
        raise RuntimeError(f"vLLM not healthy in 240 s:\n{proc.log_tail(60)}") from exc
    return proc, spec, time.monotonic() - t0


def record_extras(url: str) -> dict[str, Any]:
    """The non-script wire shapes: models, render (completion and chat), chat tokenize."""
    with httpx.Client(base_url=url, timeout=30.0) as c:
        msgs = [{"role": "user", "content": "hello cache"}]
        return {
            "models.json": c.get("/v1/models").json(),
            "render.json": c.post("/v1/completions/render",
                                  json={"model": MODEL, "prompt": "hello cache", "max_tokens": 4}).json(),
            "chat_render.json": c.post("/v1/chat/completions/render",
                                       json={"model": MODEL, "messages": msgs}).json(),
            "tokenize_chat.json": c.post("/tokenize", json={"model": MODEL, "messages": msgs,
                                                            "add_generation_prompt": True}).json(),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args(argv)
    missing = vllm_missing_reason()
    if missing:
        print(missing, file=sys.stderr)
        return 2
    run_dir = Path(tempfile.mkdtemp(prefix="kvmesh-record-"))
    events = f"tcp://127.0.0.1:{free_port()}"
    sink = EventSink(events)
    proc, spec, startup = start_vllm(run_dir, events)
    try:
        results = run_script(spec.url, sink)
        metrics = httpx.get(f"{spec.url}/metrics", timeout=10).text
        extras = record_extras(spec.url)
    finally:
        proc.stop()
        sink.close()
    version = subprocess.run([str(spec.python), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, env={**spec.env()}, check=False).stdout.strip()
    args.out.mkdir(parents=True, exist_ok=True)
    script = [jsonable({"name": r.name, "request": r.request, "response": r.response,
                        "prompt_token_ids": r.prompt_token_ids, "tokenize": r.tokenize, "messages": r.messages})
              for r in results]
    (args.out / "script.json").write_text(json.dumps(script, indent=1) + "\n")
    (args.out / "metrics.txt").write_text(metrics)
    for name, body in extras.items():
        (args.out / name).write_text(json.dumps(body, indent=1) + "\n")
    argv_shown = [a if not a.startswith(str(spec.model_dir)) else "<model_dir>" for a in spec.argv()[1:]]
    (args.out / "meta.json").write_text(json.dumps({
        "vllm_version": version, "argv": argv_shown, "startup_seconds": round(startup, 1),
        "env": {k: v for k, v in spec.env().items() if not k.endswith(("DIR", "ROOT", "HOME")) and k != "TMPDIR"},
    }, indent=1) + "\n")
    print(f"recorded {len(results)} steps to {args.out} (vLLM {version}, /health after {startup:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
