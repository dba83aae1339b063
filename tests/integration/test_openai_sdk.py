"""The official OpenAI Python SDK against the router, as users call it (issue 11, item 5).

A real mesh (etcd, the five services, two simulated vLLM engines) serves ``/v1``; the client is
``openai.OpenAI`` pointed at the router with ``max_retries=0`` (the SDK retries 429/5xx by default,
which would hide the status under test). Checked against the SDK version installed by the test
extra (``openai`` on PyPI; written against 1.x-3.x, whose exception classes are unchanged:
``BadRequestError`` 400, ``NotFoundError`` 404, ``RateLimitError`` 429, ``InternalServerError``
for >= 500, all ``APIStatusError`` subclasses carrying ``.status_code`` and the parsed ``.body``).

Covered: completions and chat completions, non-streaming and streaming (``stream=True`` yields
typed chunks; ``stream_options.include_usage`` adds a final usage chunk), ``models.list``; the
errors a user meets: bad parameter (400, ``param`` named), unknown model (404), the endpoint picker
down with the router's ``epp_failure_mode=closed`` (503: no endpoint can be chosen), each surfacing as the SDK's exception type, and the router
still serving afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh_cli.mesh import DEFAULT_MODEL, Mesh, MeshSpec
from tests.support import wait_until

pytestmark = pytest.mark.integration

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, etcd: str) -> Iterator[Mesh]:
    # epp_failure_mode=closed: with epp down the router answers 503 (the default, open, routes to
    # the least-loaded live endpoint instead); only the router reads KVMESH_ROUTER_*.
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("openai-sdk"), engines=2, etcd=etcd, time_scale=50.0,
                    lease_ttl_seconds=3, extra_env={"KVMESH_ROUTER_EPP_FAILURE_MODE": "closed"})
    with Mesh(spec) as running:
        yield running


@pytest.fixture
def client(mesh: Mesh) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{mesh.router_url}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_list(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert DEFAULT_MODEL in ids


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert out.object == "text_completion"
    assert out.model == DEFAULT_MODEL
    assert len(out.choices) == 1 and out.choices[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 5 and out.usage.prompt_tokens > 0
    assert out.id


def test_completion_stream(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=6, stream=True, stream_options={"include_usage": True},
    ))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2, chunks  # token by token, not one blob
    assert "".join(c.choices[0].text for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


def test_chat_completion(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPT}],
        max_tokens=4,
    )
    assert out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant" and message.content
    assert out.usage is not None and out.usage.completion_tokens == 4


def test_chat_completion_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 5


def test_bad_parameter_is_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=-3)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "max_tokens", body
    assert body.get("type") == "invalid_request_error"


def test_bad_parameter_streaming_raises_before_iterating(client: openai.OpenAI) -> None:
    # A stream that cannot start fails on create(), with the same type as without streaming.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1, stream=True,
        )


def test_unknown_model_is_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404
    assert isinstance(info.value.body, dict) and "no-such-model" in str(info.value.body.get("message"))


def test_no_endpoint_picker_is_503_api_status_error(mesh: Mesh, client: openai.OpenAI) -> None:
    """Last in the module: it stops the mesh's epp. The router answers 503 (never 500) and stays up."""
    epp = next(m for m in mesh.members if m.name == "epp")
    epp.process.stop(5)

    def fails_503() -> int:
        try:
            client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=2)
        except openai.APIStatusError as exc:
            return exc.status_code
        return 200

    wait_until(fails_503, 20, "the router to answer 503 with epp down", until=lambda s: s == 503, interval=0.2)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=DEFAULT_MODEL, prompt=PROMPT, max_tokens=2, stream=True)
    assert isinstance(info.value, openai.InternalServerError)  # the SDK's class for >= 500
    assert info.value.status_code == 503
    assert isinstance(info.value.body, dict) and info.value.body.get("type") == "service_unavailable"
    # The router itself is up: listing models still works.
    assert DEFAULT_MODEL in [m.id for m in client.models.list()]

