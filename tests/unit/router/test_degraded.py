"""The router's degraded-mode cores: the local admission cap and the least-request local picker."""

from __future__ import annotations

from kvmesh.types import Endpoint, EndpointId, EndpointRole
from services.router.degraded import DegradedLog, LocalAdmission, LocalPicker


def _ep(port: int, role: EndpointRole = EndpointRole.BOTH) -> Endpoint:
    return Endpoint(id=EndpointId(f"127.0.0.1:{port}"), url=f"http://127.0.0.1:{port}", model="m", role=role)


def test_local_admission_caps_in_flight_and_releases() -> None:
    local = LocalAdmission(max_in_flight=2)
    assert local.try_admit() and local.try_admit()
    assert not local.try_admit()  # the cap: the third is refused (503 + retry-after)
    local.release()
    assert local.try_admit() and local.in_flight == 2
    for _ in range(5):
        local.release()
    assert local.in_flight == 0  # never negative


def test_local_admission_fail_closed_refuses_everything() -> None:
    local = LocalAdmission(max_in_flight=100, fail_open=False)
    assert not local.try_admit() and local.in_flight == 0


def test_local_picker_prefers_least_in_flight_and_rotates_ties() -> None:
    a, b, c = _ep(1), _ep(2), _ep(3)
    picker = LocalPicker()
    firsts = {picker.order([a, b, c])[0].id for _ in range(3)}
    assert firsts == {a.id, b.id, c.id}  # idle endpoints: the tie rotates
    picker.note_start(a.id)
    picker.note_start(a.id)
    picker.note_start(b.id)
    assert [ep.id for ep in picker.order([a, b, c])] == [c.id, b.id, a.id]
    picker.note_end(a.id)
    picker.note_end(a.id)
    assert picker.in_flight(a.id) == 0
    assert picker.order([a, b, c])[-1].id == b.id


def test_local_picker_excludes_tried_and_prefill_only() -> None:
    a, b, p = _ep(1), _ep(2), _ep(3, EndpointRole.PREFILL)
    picker = LocalPicker()
    assert [ep.id for ep in picker.order([a, b, p], exclude=[a.id])] == [b.id]
    assert picker.order([p]) == []


def test_degraded_log_is_rate_limited(caplog) -> None:  # type: ignore[no-untyped-def]
    now = [0.0]
    log = DegradedLog(lambda: now[0], log_interval_seconds=10)
    with caplog.at_level("WARNING"):
        log.warn("epp", "action=%s", "picked_locally")
        for _ in range(5):
            log.warn("epp", "action=%s", "picked_locally")
        now[0] = 11
        log.warn("epp", "action=%s", "picked_locally")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == "degraded mode dependency=epp action=picked_locally"
    assert lines[1].endswith("(+5 more since the last line)")
