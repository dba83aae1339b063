"""docs/grpcurl.md cannot drift: every grpcurl line in it runs against a real mesh (issue 11, item 5).

The test parses the page's ```` ```sh ```` blocks, and runs each ``grpcurl`` line the way grpcurl does:
through server reflection only (``grpc_reflection``'s ``ProtoReflectionDescriptorDatabase`` feeds a
``DescriptorPool``; request JSON is parsed into the reflected input type, each response rendered
from the reflected output type), with the line's ``-d`` messages (several concatenated JSON objects
for client streams, an empty message without ``-d``), its address variable resolved to the mesh's
member, and ``-max-time`` read as "take what arrives, then stop". A line ending in ``# Code: X`` must
fail with that status; every other line must succeed, and the answers that say something checkable
(the value put is the value got, the model is listed, the admission is dispatched...) are checked.
Last, every method that any service lists by reflection (the reflection service itself aside) must
have a line, and every service's address a Health/Check line.

grpcurl itself is not installed here (GitHub release binary); the reflection protocol it speaks is
``grpc.reflection.v1alpha`` as served by grpcio-reflection, the same one this client uses.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvmesh_cli.mesh import DEFAULT_MODEL, Mesh, MeshSpec

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "grpcurl.md"
ADDRESS_VARS = {
    "ROUTER": "router",
    "EPP": "epp",
    "KV_INDEXER": "kv_indexer",
    "FLOW_CONTROL": "flow_control",
    "KV_STORE": "kv_store",
}
REFLECTION_PREFIX = "grpc.reflection."


@dataclass
class Line:
    """One grpcurl line of the page."""

    text: str
    address_var: str
    verb: str  # "list" | "describe" | "call"
    target: str = ""  # the symbol described, or "pkg.Service/Method"
    messages: list[dict[str, Any]] = field(default_factory=list)
    max_time: float | None = None
    expect_code: str | None = None  # grpcurl's code name, e.g. "NotFound"


def _json_messages(data: str) -> list[dict[str, Any]]:
    """grpcurl's ``-d``: zero or more JSON objects, whitespace-separated."""
    decoder = json.JSONDecoder()
    out, pos = [], 0
    data = data.strip()
    while pos < len(data):
        obj, end = decoder.raw_decode(data, pos)
        out.append(obj)
        pos = end
        while pos < len(data) and data[pos].isspace():
            pos += 1
    return out


def parse_doc(text: str) -> list[Line]:
    """Every ``grpcurl`` line inside a ```` ```sh ```` block, in page order."""
    lines: list[Line] = []
    in_sh = False
    for raw in text.splitlines():
        if raw.startswith("```"):
            in_sh = not in_sh and raw.strip() == "```sh"
            continue
        if not in_sh or not raw.startswith("grpcurl "):
            continue
        expect = None
        m = re.search(r"\s#\s*Code:\s*(\w+)\s*$", raw)
        command = raw[: m.start()] if m else raw
        if m:
            expect = m.group(1)
        tokens = shlex.split(command)[1:]
        data, max_time, positional = None, None, []
        it = iter(tokens)
        for tok in it:
            if tok == "-plaintext":
                continue
            if tok == "-d":
                data = next(it)
            elif tok == "-max-time":
                max_time = float(next(it))
            elif tok.startswith("-"):
                raise AssertionError(f"grpcurl option {tok!r} is not understood by this test: {raw}")
            else:
                positional.append(tok)
        assert positional and positional[0].startswith("$"), f"no $ADDRESS in: {raw}"
        var = positional[0][1:]
        assert var in ADDRESS_VARS, f"unknown address variable ${var} in: {raw}"
        rest = positional[1:]
        if rest[0] == "list":
            line = Line(raw, var, "list", rest[1] if len(rest) > 1 else "")
        elif rest[0] == "describe":
            line = Line(raw, var, "describe", rest[1])
        else:
            assert len(rest) == 1 and "/" in rest[0], f"expected SERVICE/METHOD in: {raw}"
            line = Line(raw, var, "call", rest[0], _json_messages(data) if data else [], max_time, expect)
        lines.append(line)
    return lines


class ReflectionClient:
    """What grpcurl does with ``-plaintext`` and no proto files: everything from server reflection."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.db = ProtoReflectionDescriptorDatabase(self.channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def services(self) -> list[str]:
        return sorted(self.db.get_services())

    def methods(self, service: str) -> list[str]:
        return [m.name for m in self.pool.FindServiceByName(service).methods]

    def describe(self, symbol: str) -> object:
        for find in (self.pool.FindServiceByName, self.pool.FindMessageTypeByName, self.pool.FindEnumTypeByName):
            try:
                return find(symbol)
            except KeyError:
                continue
        raise KeyError(symbol)

    def call(self, target: str, messages: list[dict[str, Any]], max_time: float | None) -> list[dict[str, Any]]:
        """Responses as JSON dicts (proto field names); raises grpc.RpcError on a failed status."""
        service, method_name = target.rsplit("/", 1)
        method = self.pool.FindServiceByName(service).methods_by_name[method_name]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        requests = [json_format.ParseDict(m, req_cls()) for m in messages] or [req_cls()]
        path = f"/{service}/{method_name}"
        ser, de = (lambda r: r.SerializeToString()), resp_cls.FromString
        timeout = 30.0
        if method.client_streaming:
            assert len(requests) >= 1
            if method.server_streaming:
                responses = list(self.channel.stream_stream(path, ser, de)(iter(requests), timeout=timeout))
            else:
                responses = [self.channel.stream_unary(path, ser, de)(iter(requests), timeout=timeout)]
        else:
            assert len(requests) == 1, f"{target} takes one request message"
            if method.server_streaming:
                stream = self.channel.unary_stream(path, ser, de)(requests[0], timeout=timeout)
                if max_time is not None:  # an endless stream: take the first answer, then stop
                    responses = [next(stream)]
                    stream.cancel()
                else:
                    responses = list(stream)
            else:
                responses = [self.channel.unary_unary(path, ser, de)(requests[0], timeout=timeout)]
        return [json_format.MessageToDict(r, preserving_proto_field_name=True) for r in responses]

    def close(self) -> None:
        self.channel.close()


def _grpcurl_code(code: grpc.StatusCode) -> str:
    """grpcurl prints ``Code: NotFound`` for NOT_FOUND."""
    return "".join(part.capitalize() for part in code.name.split("_"))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, etcd: str) -> Iterator[Mesh]:
    spec = MeshSpec(run_dir=tmp_path_factory.mktemp("grpcurl-doc"), engines=2, etcd=etcd, time_scale=50.0,
                    lease_ttl_seconds=3)
    with Mesh(spec) as running:
        yield running


def test_parse_doc_reads_streams_options_and_expected_codes() -> None:
    text = (
        "```sh\n"
        "grpcurl -plaintext -max-time 2 -d '{\"a\": 1} {\"b\": \"x # y\"}' $EPP pkg.S/M   # Code: NotFound\n"
        "grpcurl -plaintext $ROUTER list\n"
        "```\n"
        "grpcurl -plaintext $ROUTER outside-a-block\n"
    )
    first, second = parse_doc(text)
    assert (first.address_var, first.target, first.max_time, first.expect_code) == ("EPP", "pkg.S/M", 2.0, "NotFound")
    assert first.messages == [{"a": 1}, {"b": "x # y"}]
    assert (second.verb, second.address_var) == ("list", "ROUTER")


# Checks on the answers that say something: method -> check(responses, mesh).
def _check_get(responses: list[dict[str, Any]], mesh: Mesh) -> None:
    import base64

    data = b"".join(base64.b64decode(r.get("data", "")) for r in responses)
    assert data == b"hello kvs", data


CHECKS: dict[str, Callable[[list[dict[str, Any]], Mesh], None]] = {
    "grpc.health.v1.Health/Check": lambda r, m: _eq(r[0].get("status"), "SERVING"),
    "grpc.health.v1.Health/List": lambda r, m: _eq(
        r[0].get("statuses", {}).get("kvmesh.kv_store.v1.KVStore", {}).get("status"), "SERVING"
    ),
    "grpc.health.v1.Health/Watch": lambda r, m: _eq(r[0].get("status"), "SERVING"),
    "kvmesh.router.v1.Inference/ListModels": lambda r, m: _true(DEFAULT_MODEL in r[0].get("models", [])),
    "kvmesh.router.v1.Inference/Complete": lambda r, m: _true(r[0].get("text") and r[0].get("endpoint_id")),
    "kvmesh.router.v1.Inference/CompleteStream": lambda r, m: _true(
        len(r) >= 2 and r[-1].get("finish_reason") and "".join(c.get("text", "") for c in r)
    ),
    "kvmesh.epp.v1.EndpointPicker/ListEndpoints": lambda r, m: _eq(len(r[0].get("endpoints", [])), 2),
    "kvmesh.epp.v1.EndpointPicker/GetPickerInfo": lambda r, m: _true(r[0].get("profiles")),
    "kvmesh.epp.v1.EndpointPicker/Completed": lambda r, m: _eq(r[0].get("matched"), 1),
    "kvmesh.epp.v1.EndpointPicker/Pick": lambda r, m: _true(  # everything, or the lean answer (max_endpoints 1, omit_breakdown)
        r[0].get("target", {}).get("url") in m.engine_urls
        and (len(r[0].get("breakdown", [])) == 2 or not (r[0].get("breakdown") or r[0].get("fallbacks")))
    ),
    "kvmesh.epp.v1.EndpointPicker/PickMany": lambda r, m: _eq(
        sorted((x.get("id"), x.get("response", {}).get("target", {}).get("url") in m.engine_urls,
                x.get("error", {}).get("error_class")) for batch in r for x in batch.get("results", [])),
        [("1", True, None), ("2", False, "UnknownModel")],
    ),
    "kvmesh.flow_control.v1.FlowControl/Admit": lambda r, m: _eq(r[0].get("outcome"), "QUEUE_OUTCOME_DISPATCHED"),
    "kvmesh.kv_store.v1.KVStore/Put": lambda r, m: _true(r[0].get("medium")),
    "kvmesh.kv_store.v1.KVStore/Contains": lambda r, m: _eq(r[0].get("present"), [True, False]),
    "kvmesh.kv_store.v1.KVStore/Get": _check_get,
    "kvmesh.kv_store.v1.KVStore/Lookup": lambda r, m: _eq((r[0].get("present"), r[0].get("prefix_hits")), ([True, False], 1)),
    "kvmesh.kv_store.v1.KVStore/BatchGet": lambda r, m: _eq(
        [(x.get("index", 0), x.get("found", False)) for x in r if "found" in x or x.get("index", 0) == 1][:2], [(0, True), (1, False)]
    ),
    "kvmesh.kv_indexer.v1.KVIndexer/EndpointBlocks": lambda r, m: _true("block_hashes" in r[0] or "state" in r[0]),
    "kvmesh.kv_store.v1.KVStore/Delete": lambda r, m: _eq(r[0].get("deleted"), True),
}


def _eq(got: object, want: object) -> None:
    assert got == want, f"{got!r} != {want!r}"


def _true(value: object) -> None:
    assert value, value


def test_every_grpcurl_line_in_the_doc_works(mesh: Mesh) -> None:
    lines = parse_doc(DOC.read_text())
    assert len(lines) >= 20, f"only {len(lines)} grpcurl lines parsed from {DOC}"
    addresses = {var: next(m.grpc for m in mesh.members if m.name == name) for var, name in ADDRESS_VARS.items()}
    clients = {var: ReflectionClient(addr or "") for var, addr in addresses.items()}
    endpoint_id = mesh.engine_urls[0].removeprefix("http://")
    try:
        called: set[str] = set()
        checked: set[str] = set()
        health_checked: set[str] = set()
        for line in lines:
            client = clients[line.address_var]
            if line.verb == "list":
                services = client.services()
                assert services, line.text
                if line.target:
                    assert client.methods(line.target), line.text
                continue
            if line.verb == "describe":
                client.describe(line.target)
                continue
            if line.expect_code:
                with pytest.raises(grpc.RpcError) as info:
                    client.call(line.target, line.messages, line.max_time)
                assert _grpcurl_code(info.value.code()) == line.expect_code, (line.text, info.value.details())
                continue
            line.messages = [json.loads(json.dumps(m).replace("$ENDPOINT", endpoint_id)) for m in line.messages]
            try:
                responses = client.call(line.target, line.messages, line.max_time)
            except grpc.RpcError as exc:
                raise AssertionError(f"{line.text}\n-> {exc.code().name}: {exc.details()}") from None
            assert responses, line.text
            called.add(line.target)
            if line.target == "grpc.health.v1.Health/Check":
                health_checked.add(line.address_var)
            check = CHECKS.get(line.target)
            if check is not None:
                try:
                    check(responses, mesh)
                except AssertionError as exc:
                    raise AssertionError(f"{line.text}\n-> {responses}\n{exc}") from None
                checked.add(line.target)

        listed = {
            f"{service}/{method}"
            for client in clients.values()
            for service in client.services()
            if not service.startswith(REFLECTION_PREFIX)
            for method in client.methods(service)
        }
        missing = sorted(listed - called)
        assert not missing, f"methods served but without a working line in {DOC.name}: {missing}"
        assert health_checked == set(ADDRESS_VARS), f"Health/Check lines missing for {set(ADDRESS_VARS) - health_checked}"
        assert set(CHECKS) <= checked, f"answers never checked: {set(CHECKS) - checked}"
    finally:
        for client in clients.values():
            client.close()
