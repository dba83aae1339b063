"""Every ``bench/*.py`` command line refuses abbreviated options, as the ``kvmesh`` CLI does.

argparse's default (``allow_abbrev=True``) took ``--req 5`` for ``--requests 5``, and ``--con`` for whichever
option it happened to prefix: a typo or a half-remembered option ran a different benchmark than the one
written down. Each script exposes ``build_parser()``; this parses with it (no benchmark runs) and checks
that the commands the docs give still parse.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if "ArgumentParser(" in p.read_text())
OTHER_VENV = {"lmcache_client_driver"}
"""Scripts that run in another virtualenv (``.venv-lmcache``: torch, lmcache) and so cannot be imported here:
their ``build_parser`` is compiled alone from the source, with ``argparse`` as its only global."""


def build_parser(script: str) -> argparse.ArgumentParser:
    if script in OTHER_VENV:
        source = (BENCH / f"{script}.py").read_text()
        [func] = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "build_parser"]
        namespace: dict[str, Any] = {"argparse": argparse}
        exec(compile(ast.Module(body=[func], type_ignores=[]), f"bench/{script}.py", "exec"), namespace)
        built: argparse.ArgumentParser = namespace["build_parser"]()
        return built
    module = importlib.import_module(f"bench.{script}")
    parser: argparse.ArgumentParser = module.build_parser()
    return parser


def long_options(parser: argparse.ArgumentParser) -> list[str]:
    return sorted(s for action in parser._actions for s in action.option_strings
                  if s.startswith("--") and s != "--help")


def test_every_script_with_a_parser_is_covered() -> None:
    assert len(SCRIPTS) >= 17, SCRIPTS
    for script in SCRIPTS:
        tree = ast.parse((BENCH / f"{script}.py").read_text())
        builders = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_parser"]
        assert builders, f"bench/{script}.py builds its ArgumentParser outside build_parser()"


def required_args(parser: argparse.ArgumentParser) -> list[str]:
    """A value for each required option (``--servers``), so parsing gets as far as the unknown ones."""
    return [arg for action in parser._actions if action.required and action.option_strings
            for arg in (action.option_strings[0], "1")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_abbreviations_are_refused(script: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(script)
    assert parser.allow_abbrev is False
    options = long_options(parser)
    assert options, f"bench/{script}.py has no long option"
    checked = 0
    for option in options:
        prefix = option[: max(3, len(option) - 2)]
        if prefix in options:
            continue
        # refused as unknown; with abbreviations it was taken for `option` (a flag parsed fine, an option
        # with a value said "expected one argument") or, prefixing several, "ambiguous option"
        with pytest.raises(SystemExit) as caught:
            parser.parse_args([*required_args(parser), prefix])
        err = capsys.readouterr().err
        assert caught.value.code == 2 and f"unrecognized arguments: {prefix}" in err, (option, err)
        checked += 1
    assert checked, options


def test_the_issue_case_req_for_requests() -> None:
    parser = build_parser("router_overhead")
    assert parser.parse_args(["--requests", "5"]).requests == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--req", "5"])


DOCUMENTED = re.compile(r"bench/(?P<script>[a-z_]+)\.py(?P<rest>[^\n`|]*)")


def documented_commands() -> list[tuple[str, str, str]]:
    """``(file, script, option)`` for every ``--option`` written after ``bench/<script>.py`` on one line of
    the docs, the READMEs, the Makefile and the bench scripts' own docstrings."""
    files = [*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), *(REPO / "services").glob("*/README.md"),
             REPO / "Makefile", *BENCH.glob("*.py"), *BENCH.glob("*.sh")]
    found = []
    for path in files:
        for match in DOCUMENTED.finditer(path.read_text(errors="replace")):
            if match.group("script") not in SCRIPTS:
                continue
            for option in re.findall(r"(?<![\w-])--[a-z][\w-]*", match.group("rest")):
                found.append((str(path.relative_to(REPO)), match.group("script"), option))
    return found


def test_documented_commands_use_whole_option_names() -> None:
    """A documented command that relied on an abbreviation would now fail: none does."""
    commands = documented_commands()
    assert len(commands) > 50, commands  # the docs do show many bench command lines
    parsers = {script: build_parser(script) for script in {script for _, script, _ in commands}}
    unknown = [(where, script, option) for where, script, option in commands
               if option not in long_options(parsers[script]) and option != "--help"]
    assert not unknown, unknown
