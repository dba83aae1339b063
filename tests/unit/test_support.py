"""tests/support.py: the one deadline-poll and the vendored recordings."""

from __future__ import annotations

import itertools

import pytest

from tests.support import RECORDINGS_DIR, TESTS_DIR, WaitTimeout, recording, wait_until, wait_until_async


def test_wait_until_returns_the_first_accepted_value() -> None:
    counter = itertools.count()
    assert wait_until(lambda: next(counter), 5, "three", until=lambda n: n >= 3, interval=0) == 3


def test_wait_until_names_what_and_the_last_value_on_timeout() -> None:
    with pytest.raises(WaitTimeout, match=r"waiting for the answer; last seen: 41") as info:
        wait_until(lambda: 41, 0.05, "the answer", until=lambda n: n == 42, interval=0.01)
    assert isinstance(info.value, AssertionError) and info.value.last == 41


def test_wait_until_tolerates_only_the_ignored_errors() -> None:
    calls = itertools.count()

    def flaky() -> bool:
        if next(calls) < 2:
            raise ConnectionError("not yet")
        return True

    assert wait_until(flaky, 5, "a connection", interval=0, ignore=(ConnectionError,)) is True
    with pytest.raises(ValueError):
        wait_until(lambda: int("x"), 5, "a number", ignore=(ConnectionError,))


async def test_wait_until_async_awaits_probes_and_runs_before_each() -> None:
    sent: list[int] = []

    async def received() -> int:
        return len(sent)

    got = await wait_until_async(received, 5, "three sends", until=lambda n: n >= 3, interval=0,
                                 before_each=lambda: sent.append(1))
    assert got == 3
    with pytest.raises(WaitTimeout, match="last seen: 0"):
        await wait_until_async(lambda: 0, 0.05, "a plain probe", interval=0.01)


def test_recordings_are_vendored_and_a_missing_one_fails() -> None:
    assert RECORDINGS_DIR.is_relative_to(TESTS_DIR)  # in the repository, not the workplace's shared data
    assert recording("metrics_exposition.txt").stat().st_size > 0
    with pytest.raises(pytest.fail.Exception, match="recording missing"):
        recording("no-such-file.jsonl")
