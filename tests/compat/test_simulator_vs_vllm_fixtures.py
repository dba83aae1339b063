"""The engine simulator against recorded real-vLLM 0.32.0 answers to the compat script (no vLLM needed).

The fixtures (``fixtures/vllm-0.32.0/``, written by ``python -m tests.compat.record_vllm``) hold what
vLLM answered to :data:`tests.compat.script.STEPS`. Here the simulator, started as a process with
the same cache shape, runs the same script, and its events, usage, tokenization and metrics must
have the same shape and the same cached-token counts. Deliberate differences are named in
:mod:`tests.compat.compare`; anything else fails. ``test_vllm_live.py`` checks the fixtures still
match a live vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_http_ok
from tests.compat import compare
from tests.compat.script import (
    BLOCK,
    MAX_MODEL_LEN,
    MODEL,
    NUM_GPU_BLOCKS,
    STEPS,
    EventSink,
    StepResult,
    run_script,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "vllm-0.32.0"

pytestmark = pytest.mark.skipif(not (FIXTURES / "script.json").is_file(), reason="vLLM fixtures not recorded")


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, Any]]:
    return json.loads((FIXTURES / "script.json").read_text())


@pytest.fixture(scope="module")
def simulated(run_dir: Path) -> Iterator[tuple[list[StepResult], str]]:
    port = free_port()
    events = f"tcp://127.0.0.1:{free_port()}"
    sink = EventSink(events)
    proc = ManagedProcess(
        f"compat-sim-{port}",
        python_module("engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                      "--block-size-tokens", str(BLOCK), "--num-gpu-blocks", str(NUM_GPU_BLOCKS),
                      "--max-model-len", str(MAX_MODEL_LEN), "--events-endpoint", events,
                      "--etcd-endpoints", "", "--tokenizer-path", str(run_dir / "tokenizer")),
        run_dir / f"compat-sim-{port}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", 30)
        # the SUB attaches the simulator's PUB only while polling: wait for the connection
        sink.settle(0.5)
        results = run_script(url, sink)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        yield results, metrics
    finally:
        proc.stop()
        sink.close()


def test_fixture_covers_the_script(recorded: list[dict[str, Any]]) -> None:
    assert [r["name"] for r in recorded] == [s["name"] for s in STEPS]


def test_same_tokens_for_the_same_text(recorded: list[dict[str, Any]], simulated: Any) -> None:
    results, _ = simulated
    for rec, sim in zip(recorded, results, strict=True):
        if rec["tokenize"] is not None:
            assert sim.tokenize is not None
            assert list(sim.tokenize) == list(rec["tokenize"]) or set(sim.tokenize) == set(rec["tokenize"])
            assert sim.tokenize["tokens"] == rec["tokenize"]["tokens"], rec["name"]


def test_same_cached_tokens_and_counts(recorded: list[dict[str, Any]], simulated: Any) -> None:
    results, _ = simulated
    rows = []
    for rec, sim in zip(recorded, results, strict=True):
        if rec["request"] is None:
            continue
        ru, su = rec["response"]["usage"], sim.response["usage"]
        rows.append((rec["name"], ru["prompt_tokens"], su["prompt_tokens"], ru["completion_tokens"],
                     su["completion_tokens"], ru["prompt_tokens_details"]["cached_tokens"],
                     su["prompt_tokens_details"]["cached_tokens"]))
    mismatched = [r for r in rows if r[1] != r[2] or r[3] != r[4] or r[5] != r[6]]
    assert not mismatched, f"(step, prompt vllm/sim, completion vllm/sim, cached vllm/sim): {mismatched}"


def test_usage_shape(recorded: list[dict[str, Any]], simulated: Any) -> None:
    results, _ = simulated
    rec = next(r for r in recorded if r["request"])
    sim = next(r for r in results if r.request)
    vllm_keys = compare.usage_shape(rec["response"])
    sim_keys = compare.usage_shape(sim.response)
    # same order for the keys both have; the rest are the simulator's listed, deliberate omissions
    assert [k for k in vllm_keys if k in sim_keys] == sim_keys
    assert set(vllm_keys) - set(sim_keys) == compare.SIMULATOR_USAGE_DIFFERENCES


def test_event_shapes_and_counts(recorded: list[dict[str, Any]], simulated: Any) -> None:
    results, _ = simulated
    vllm_events = [e for r in recorded for m in r["messages"] for e in m["payload"][1]]
    sim_events = [e for r in results for m in r.messages for e in m["payload"][1]]
    assert compare.event_shapes(sim_events) == compare.event_shapes(vllm_events)
    per_step = [(rec["name"], compare.event_counts([e for m in rec["messages"] for e in m["payload"][1]]),
                 compare.event_counts([e for m in sim.messages for e in m["payload"][1]]))
                for rec, sim in zip(recorded, results, strict=True)]
    # blocks stored, blocks removed (eviction order = vLLM's free-queue order) and clears, step by step
    differing = {name: (v, s) for name, v, s in per_step if v != s}
    assert differing == {}, f"(vllm, simulator) event counts: {differing}"
    # message framing: topic names the endpoint and model; payload is [ts, events, dp_rank]
    for m in (recorded[0]["messages"][0], results[0].messages[0]):
        assert m["topic"].startswith("kv@127.0.0.1:") and m["topic"].endswith(f"@{MODEL}")
        ts, events, rank = m["payload"]
        assert isinstance(ts, float) and isinstance(events, list) and rank == 0


def test_prompt_block_hashes_match_kvmesh(recorded: list[dict[str, Any]], simulated: Any) -> None:
    """Both engines store, for a new prompt, exactly the hashes kvmesh computes for its full blocks."""
    results, _ = simulated
    for rec, sim in zip(recorded, results, strict=True):
        if rec["name"] not in ("text-a", "ids-aligned", "unrelated-1", "unrelated-2", "unrelated-3"):
            continue
        ids = rec["prompt_token_ids"]
        expected = compare.prompt_hashes(ids, BLOCK)
        assert expected, rec["name"]
        vllm_events = [e for m in rec["messages"] for e in m["payload"][1]]
        sim_events = [e for m in sim.messages for e in m["payload"][1]]
        assert compare.stored_prompt_hashes(vllm_events, ids, BLOCK) == expected, rec["name"]
        assert compare.stored_prompt_hashes(sim_events, ids, BLOCK) == expected, rec["name"]


def test_metrics_epp_reads_and_family_shapes(simulated: Any) -> None:
    _, sim_metrics = simulated
    vllm_metrics = (FIXTURES / "metrics.txt").read_text()
    assert compare.epp_metric_problems(vllm_metrics) == []
    assert compare.epp_metric_problems(sim_metrics) == []
    vllm_fams, sim_fams = compare.metric_families(vllm_metrics), compare.metric_families(sim_metrics)
    # every family the simulator exposes exists in vLLM with the same type and labels
    # (the simulator exposes a subset on purpose: see engine_simulator/README.md)
    differing = {n: (sim_fams[n], vllm_fams.get(n)) for n in sim_fams if sim_fams[n] != vllm_fams.get(n)}
    assert differing == {}
