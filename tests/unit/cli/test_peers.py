"""Peer router command lines (sglang-router 0.3.2, vllm-router 0.1.17 flags, from their ``--help``) and the
not-installed error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh_cli.peers import PEERS, PEERS_VENV_ENV, peer_argv, peer_missing_reason


def test_sglang_router_gets_the_local_tokenizer_text_prompts_and_loopback_metrics() -> None:
    spec = PEERS["sglang-router"]
    argv = peer_argv(spec, 9000, 9001, ["http://127.0.0.1:1", "http://127.0.0.1:2"], Path("/tok"), Path("/v"))
    assert argv[:3] == ["/v/bin/python", "-m", "sglang_router.launch_router"]
    assert argv[argv.index("--policy") + 1] == "cache_aware" and argv[argv.index("--tokenizer-path") + 1] == "/tok"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1" and argv[argv.index("--host") + 1] == "127.0.0.1"
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert spec.prompt_format == "text"  # it answers 422 to token ids


@pytest.mark.parametrize(("name", "policy"), [("vllm-router-cache-aware", "cache_aware"),
                                              ("vllm-router-round-robin", "round_robin")])
def test_vllm_router_queue_is_opened_past_any_replay(name: str, policy: str) -> None:
    argv = peer_argv(PEERS[name], 9000, 9001, ["http://127.0.0.1:1"], Path("/tok"), Path("/v"))
    assert argv[0] == "/v/bin/vllm-router" and argv[argv.index("--policy") + 1] == policy
    assert int(argv[argv.index("--queue-size") + 1]) >= 10_000  # its default, 100, answers 429 under load
    assert PEERS[name].prompt_format == "tokens"


def test_missing_and_unknown_peers_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    assert "make peers-env" in (peer_missing_reason("sglang-router") or "")
    assert "unknown peer" in (peer_missing_reason("nginx") or "")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "vllm-router").touch()
    assert peer_missing_reason("vllm-router-round-robin") is None
