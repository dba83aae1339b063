"""Pins of stored responses (``services/router/response_affinity.py``) and engine error mapping (vLLM 0.32 shapes)."""

from __future__ import annotations

import json

import pytest

from kvmesh import errors
from kvmesh.types import Endpoint, EndpointId
from services.router.http_errors import error_from_engine, http_error
from services.router.response_affinity import (
    ResponseAffinity,
    StoredResponseGone,
    pinned_endpoint,
    response_id_in_events,
    response_id_of,
    stores,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lru_bound_and_ttl() -> None:
    clock = Clock()
    pins = ResponseAffinity(max_entries=2, ttl_seconds=10, clock=clock)
    pins.remember("resp_a", "e1", "m")
    pins.remember("resp_b", "e2", "m")
    assert pins.endpoint_for("resp_a") == "e1"  # touched: resp_b is now the oldest
    pins.remember("resp_c", "e1", "m")
    assert pins.endpoint_for("resp_b") is None and pins.holder("resp_c") == ("e1", "m") and len(pins) == 2
    clock.now = 10.0
    assert pins.endpoint_for("resp_a") is None and len(pins) == 1  # expired and dropped
    assert pins.endpoint_for(None) is None and pins.endpoint_for("") is None
    off = ResponseAffinity(max_entries=0, ttl_seconds=10)
    off.remember("resp_a", "e1")
    assert off.endpoint_for("resp_a") is None


def test_pinned_endpoint() -> None:
    live = [Endpoint(id=EndpointId("h:1"), url="http://h:1", model="m", block_size_tokens=16),
            Endpoint(id=EndpointId("h:2"), url="http://h:2", model="m", block_size_tokens=16)]
    assert pinned_endpoint("m", "resp_x", "h:2", live, []).id == "h:2"
    with pytest.raises(errors.NoEndpointsAvailable):
        pinned_endpoint("m", "resp_x", "h:2", live, ["h:2"])
    with pytest.raises(StoredResponseGone) as gone:
        pinned_endpoint("m", "resp_x", "h:3", live, [])
    err = http_error(gone.value)  # vLLM 0.32's _make_not_found_error: 404, invalid_request_error, response_id
    assert err.status == 404 and err.body["error"]["type"] == "invalid_request_error"
    assert err.body["error"]["param"] == "response_id"
    assert str(err.body["error"]["message"]).startswith("Response with id 'resp_x' not found.")


def test_response_ids_from_answers() -> None:
    assert response_id_of(json.dumps({"id": "resp_1", "object": "response"}).encode()) == "resp_1"
    assert response_id_of(b'{"id": "cmpl-1", "object": "text_completion"}') is None
    assert response_id_of(b"not json") is None
    created = {"type": "response.created", "sequence_number": 0, "response": {"id": "resp_2", "status": "in_progress"}}
    raw = b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n"
    assert response_id_in_events(raw) == "resp_2"
    assert response_id_in_events(b'event: response.output_text.delta\ndata: {"delta": "x"}\n\n') is None
    assert stores({}) and stores({"store": True}) and not stores({"store": False})


@pytest.mark.parametrize(("status", "body", "cls", "message"), [
    (400, {"error": {"message": "too long", "type": "BadRequestError", "param": None, "code": 400}},
     errors.InvalidRequest, "too long"),
    (422, {"detail": [{"msg": "bad"}]}, errors.InvalidRequest, "engine answered HTTP 422"),
    (401, {"error": "Unauthorized"}, errors.Unauthenticated, "Unauthorized"),  # vLLM's --api-key answer
    (403, {"detail": "Forbidden"}, errors.Unauthenticated, "Forbidden"),
    (404, {"error": {"message": "Response with id 'r' not found."}}, errors.NotFound, "Response with id 'r' not found."),
    (429, {"message": "busy"}, errors.Saturated, "busy"),
    (500, b"", errors.NoEndpointsAvailable, "engine answered HTTP 500"),
    (503, {"error": {"message": "sleeping"}}, errors.NoEndpointsAvailable, "sleeping"),
    (504, {}, errors.QueueTTLExpired, "engine answered HTTP 504"),
])
def test_engine_errors_keep_status_class_and_message(status: int, body: object, cls: type, message: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    err = error_from_engine(status, raw)
    assert isinstance(err, cls) and str(err).startswith(message)  # a body without a message: its excerpt follows
    assert errors.mapping_for(err) is not errors.INTERNAL  # never the generic "internal error"


def test_in_stream_error_events_map_like_statuses() -> None:
    from services.router.http_errors import error_from_stream_event

    logprobs = {"message": "Requested sample logprobs of 50, which is greater than max allowed: 20",
                "type": "BadRequestError", "param": "logprobs", "code": 400}
    err = error_from_stream_event(logprobs)  # vLLM 0.32 streams this as 200 + data: {"error": ...}
    assert isinstance(err, errors.InvalidRequest) and str(err) == logprobs["message"]
    assert isinstance(error_from_stream_event({"message": "boom"}), errors.NoEndpointsAvailable)
    assert str(error_from_stream_event("plain")) == "plain"
