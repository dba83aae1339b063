"""``kvmesh replay --router ... --epp/--etcd``: a dead or malformed address is one clean error before any
request is sent, or, with ``--etcd``, a fallback said in one line; never a traceback.

The fallbacks through a live etcd and a live epp are in ``tests/integration/test_replay_discovery.py``.
"""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from kvmesh_cli import main as cli
from kvmesh_cli.discovery import DiscoveryError, find_engines, split_host_port
from kvmesh_cli.launcher import free_port


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, ["replay", "--requests", "1", *args], env={"COLUMNS": "200"})
    assert "Traceback" not in result.output, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    ("address", "parsed"),
    [("127.0.0.1:2379", ("127.0.0.1", 2379)), ("localhost:1", ("localhost", 1)), ("[::1]:9001", ("::1", 9001))],
)
def test_split_host_port(address: str, parsed: tuple[str, int]) -> None:
    assert split_host_port(address) == parsed


@pytest.mark.parametrize("address", ["notaport", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", ":80",
                                     "http://127.0.0.1:1", "127.0.0.1:x"])
def test_split_host_port_rejects(address: str) -> None:
    with pytest.raises(ValueError, match="host:port"):
        split_host_port(address)


@pytest.mark.parametrize("option", ["--epp", "--etcd"])
@pytest.mark.parametrize("value", ["notaport", "http://127.0.0.1:1"])
def test_malformed_address_is_a_usage_error(option: str, value: str) -> None:
    code, out = invoke("--router", "http://127.0.0.1:1", option, value)
    assert code == 2, out
    assert f"Invalid value for {option}" in out and "host:port" in out


def test_dead_epp_without_etcd_fails_fast_in_one_line_naming_it_and_what_to_do() -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, out = invoke("--router", "http://127.0.0.1:1", "--epp", dead)
    assert time.monotonic() - started < 10
    assert code == 1, out
    [line] = error_lines(out)
    assert f"epp {dead} refused the connection (UNAVAILABLE)" in line
    assert "--etcd" in line and "kvmesh up prints it" in line
    assert "router" not in out  # failed before the router or any request


def test_dead_etcd_fails_fast_in_one_line_without_background_retries(caplog: pytest.LogCaptureFixture) -> None:
    dead = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, out = invoke("--router", "http://127.0.0.1:1", "--etcd", dead)
    assert time.monotonic() - started < 10
    assert code == 1, out
    [line] = error_lines(out)
    assert line.startswith(f"error: etcd {dead} refused the connection") and "leave --etcd out" in line
    assert "dependency=etcd" not in out + caplog.text  # read once, not watched (no watcher retrying)


def test_dead_epp_falls_back_to_etcd_then_goes_on(etcd: str) -> None:
    """A live etcd (the session's) with no epp answering: the engines registered there are used, said
    in one line each, and the replay goes on to the router (dead here: its own one-line error)."""
    dead = f"127.0.0.1:{free_port()}"
    code, out = invoke("--router", "http://127.0.0.1:1", "--epp", dead, "--etcd", etcd)
    assert code == 1, out
    assert f"epp {dead} refused the connection (UNAVAILABLE): looking for another in etcd {etcd}" in out
    assert f"registered in etcd {etcd}" in out
    [line] = error_lines(out)
    assert line.startswith("error: router http://127.0.0.1:1 is unreachable")


def test_find_engines_without_epp_or_etcd_is_empty_and_says_nothing() -> None:
    said: list[str] = []
    assert find_engines(None, None, said.append) == []
    assert said == []


def test_find_engines_dead_epp_and_dead_etcd_names_etcd() -> None:
    epp, etcd = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    said: list[str] = []
    with pytest.raises(DiscoveryError, match=f"^etcd {etcd} refused the connection") as caught:
        find_engines(epp, etcd, said.append, timeout_s=2)
    assert "\n" not in str(caught.value)
    assert said == [f"epp {epp} refused the connection (UNAVAILABLE): looking for another in etcd {etcd}"]
