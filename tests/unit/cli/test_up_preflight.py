"""``kvmesh up`` (and ``replay``/``compare``, which start meshes too) check ``--policy`` files and ``--etcd``
before anything starts: one error line naming the option and the problem, exit 2, no run folder.

Before, ``kvmesh up --policy bad.yaml`` started etcd and every service, epp died on the file, and the
command exited 1 after a ~2 KB epp config line; ``kvmesh up --etcd garbage`` exited 1 and left a
``.run/up-*`` folder although ``--help`` says exit 2 for bad options (fresh-user report).
"""

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvmesh_cli.checks import EPP_CONFIGS_DIR, check_scheduling_config, known_policies, resolve_policy
from kvmesh_cli.main import app

BAD_POLICIES = {
    "not-yaml": ("foo: [\n", "not valid YAML/JSON"),
    "unknown-key": ("scorers: 5\n", "scorers: Extra inputs are not permitted"),
    "not-a-mapping": ("[1, 2]\n", "expected a mapping with 'plugins' and 'profiles', got list"),
    "unknown-plugin": ("plugins:\n  - type: nope\nprofiles:\n  - name: d\n    plugins: [{ref: nope}]\n",
                       "plugins[0]: unknown plugin type 'nope'"),
    # a consumer without its producer: refused by build_profile, past the schema (epp's own check)
    "missing-prepare-step": ("plugins:\n  - type: precise-prefix-cache-scorer\nprofiles:\n  - name: d\n"
                             "    plugins: [{ref: precise-prefix-cache-scorer}]\n", "consumes 'prefix-match'"),
}
BAD_ETCD = {
    "garbage": "'garbage' is not host:port",
    "127.0.0.1:99999": "the port 99999 is not in 1-65535",
    "127.0.0.1:0": "the port 0 is not in 1-65535",
    "127.0.0.1:abc": "the port 'abc' is not an integer",
    "http://127.0.0.1:2379": "is a URL; expected host:port",
    "": "'' is not host:port",
}
# the options every mesh-starting command needs to get past its other checks quickly
COMMANDS = {"up": [], "replay": ["--requests", "2"], "compare": ["--requests", "2"]}


def _invoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "400"})
    return result.exit_code, result.output


def _error_line(out: str) -> str:
    [line] = [line for line in out.splitlines() if line.startswith("Error:")]
    return line


def _nothing_started(tmp_path: Path, out: str) -> None:
    assert not (tmp_path / ".run").exists(), out
    assert "starting mesh" not in out and "logs in" not in out, out


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case", list(BAD_POLICIES))
def test_a_policy_file_epp_would_refuse_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, case: str,
) -> None:
    text, said = BAD_POLICIES[case]
    policy = tmp_path / f"{case}.yaml"
    policy.write_text(text)
    option = "--policies" if command == "compare" else "--policy"
    code, out = _invoke(tmp_path, monkeypatch, command, option, str(policy), *COMMANDS[command])
    assert code == 2, out
    line = _error_line(out)
    assert line.startswith(f"Error: Invalid value for {option}: {policy}: "), line
    assert said in line, line
    _nothing_started(tmp_path, out)


def test_compare_checks_every_policy_column(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("scorers: 5\n")
    code, out = _invoke(tmp_path, monkeypatch, "compare", "--policies", f"round-robin,{policy}", "--requests", "2")
    assert code == 2, out
    assert f"--policies: {policy}: " in _error_line(out)
    _nothing_started(tmp_path, out)


@pytest.mark.parametrize("command", [*COMMANDS, "flows"])
@pytest.mark.parametrize("value", list(BAD_ETCD))
def test_a_malformed_etcd_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str, value: str,
) -> None:
    code, out = _invoke(tmp_path, monkeypatch, command, "--etcd", value, *COMMANDS.get(command, []))
    assert code == 2, out
    line = _error_line(out)
    assert line.startswith("Error: Invalid value for --etcd: "), line
    assert BAD_ETCD[value] in line, line
    _nothing_started(tmp_path, out)


def test_up_with_a_bad_policy_and_its_own_run_dir_creates_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("foo: [\n")
    code, out = _invoke(tmp_path, monkeypatch, "up", "--policy", str(policy), "--run-dir", str(tmp_path / "run"))
    assert code == 2, out
    assert not (tmp_path / "run").exists()
    _nothing_started(tmp_path, out)


def test_the_yaml_error_is_one_line_without_the_source_excerpt(tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("foo: [\n")
    with pytest.raises(typer.BadParameter) as exc_info:
        check_scheduling_config(policy)
    message = exc_info.value.message
    assert "\n" not in message and "^" not in message and "<unicode string>" not in message
    assert message.startswith(f"{policy}: not valid YAML/JSON: ") and message.endswith("at line 2, column 1"), message


@pytest.mark.parametrize("name", known_policies())
def test_every_shipped_policy_passes_the_check(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_policy(name) == name
    copy = tmp_path / f"{name}.yaml"  # the same content given as a file: accepted, as an absolute path
    copy.write_text((EPP_CONFIGS_DIR / f"{name}.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert resolve_policy(copy.name) == str(copy)


@pytest.mark.parametrize("value", ["127.0.0.1:2379", "localhost:1", "[::1]:65535"])
def test_a_good_etcd_gets_past_the_option_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str,
) -> None:
    """A well-formed --etcd is not refused by the option check (the bad --policy after it is what fails)."""
    code, out = _invoke(tmp_path, monkeypatch, "up", "--etcd", value, "--policy", "nope")
    assert code == 2, out
    assert "Invalid value for --policy" in _error_line(out)
