"""The registration sidecar as a process, against a real etcd and a real engine process.

The engine is the simulator started with ``--etcd-endpoints ""`` (it does not register itself),
so the only registration is the sidecar's. SIGSTOP freezes the engine (its /health times out):
shorter than ``--unresponsive-grace-seconds`` it is a busy engine and stays registered (issue 14),
longer it is deregistered; SIGCONT thaws it (re-registered), SIGTERM to the sidecar revokes the lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from kvmesh.membership import EndpointWatcher
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok

pytestmark = pytest.mark.integration

MODEL = "sidecar-tiny"


async def test_sidecar_follows_engine_health(run_dir: Path, etcd: str) -> None:
    port = free_port()
    engine = ManagedProcess(
        f"sidecar-engine-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                      "--block-size-tokens", "32", "--num-gpu-blocks", "64", "--max-model-len", "1024",
                      "--events-endpoint", "", "--etcd-endpoints", "",
                      "--tokenizer-path", str(run_dir / "tokenizer")),
        run_dir / f"sidecar-engine-{port}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    sidecar = ManagedProcess(
        f"sidecar-{port}",
        python_module("services.registration_sidecar", "--engine-url", url, "--model", MODEL,
                      "--block-size-tokens", "32", "--events-endpoint", "tcp://127.0.0.1:5999",
                      "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", "--health-interval-seconds", "0.2",
                      "--health-timeout-seconds", "0.3", "--failure-threshold", "2",
                      "--unresponsive-grace-seconds", "3"),
        run_dir / f"sidecar-{port}.log",
    )
    watcher = EndpointWatcher([etcd], model=MODEL)
    await watcher.start()
    try:
        wait_http_ok(f"{url}/health", 30)
        sidecar.start()
        ep_id = f"127.0.0.1:{port}"
        assert await watcher.wait_for(lambda s: ep_id in s, 15), sidecar.log_tail()
        ep = watcher.snapshot()[ep_id]
        assert ep.url == url and ep.block_size_tokens == 32 and ep.events_endpoint == "tcp://127.0.0.1:5999"
        assert ep.labels == {"engine": "vllm", "max_model_len": "1024"}  # from the engine's /v1/models

        os.killpg(engine.pid, signal.SIGSTOP)  # busy for 1.5 s (< the 3 s grace): stays registered
        seen_leave = await watcher.wait_for(lambda s: ep_id not in s, 1.5)
        os.killpg(engine.pid, signal.SIGCONT)
        assert not seen_leave, sidecar.log_tail()
        await asyncio.sleep(1.0)  # a few good polls reset the grace
        assert ep_id in watcher.snapshot()

        os.killpg(engine.pid, signal.SIGSTOP)  # frozen past the grace: deregistered
        assert await watcher.wait_for(lambda s: ep_id not in s, 10), sidecar.log_tail()
        os.killpg(engine.pid, signal.SIGCONT)
        assert await watcher.wait_for(lambda s: ep_id in s, 10), sidecar.log_tail()

        sidecar.stop()  # SIGTERM: the lease is revoked, not left to expire
        assert await watcher.wait_for(lambda s: ep_id not in s, 2.5), sidecar.log_tail()
        assert sidecar.proc is not None and sidecar.proc.returncode == 0
    finally:
        if engine.alive():
            os.killpg(engine.pid, signal.SIGCONT)
        sidecar.stop()
        engine.stop()
        await watcher.stop()
