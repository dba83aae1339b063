"""A response stream the client cancels (or the server stops under) ends its trace span in the RPC's own
task: no "Failed to detach context" traceback from ``opentelemetry.context`` (a CI run caught one from
kv_indexer's ``Watch`` at mesh stop), for each streaming shape the services serve (server stream: kv_indexer
``Watch``, router ``CompleteStream``; bidi: flow_control ``Admit``), over a real in-process grpc.aio server
with the shared interceptor chain. Checked with opentelemetry-instrumentation-grpc 0.66b2, grpcio 1.85."""

from __future__ import annotations

import asyncio
import gc
import logging

import grpc
import pytest

from kvmesh._proto.kvmesh.flow_control.v1 import flow_control_pb2, flow_control_pb2_grpc
from kvmesh._proto.kvmesh.kv_indexer.v1 import kv_indexer_pb2, kv_indexer_pb2_grpc
from kvmesh.interceptors import server_interceptors

TRACEPARENT = ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")


class Streams:
    """Both servicers' streams yield forever; ``closed`` counts streams whose generator was closed."""

    def __init__(self) -> None:
        self.closed = 0
        self.started = asyncio.Event()


class Indexer(kv_indexer_pb2_grpc.KVIndexerServicer):
    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def Watch(self, request, context):  # type: ignore[no-untyped-def,override]
        try:
            while True:
                self.streams.started.set()
                yield kv_indexer_pb2.WatchResponse(prev_seq=1, seq=1)
                await asyncio.sleep(0.001)
        finally:
            self.streams.closed += 1


class Flow(flow_control_pb2_grpc.FlowControlServicer):
    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    async def Admit(self, request_iterator, context):  # type: ignore[no-untyped-def,override]
        try:
            while True:
                self.streams.started.set()
                yield flow_control_pb2.AdmitResponse(reason="x")
                await asyncio.sleep(0.001)
        finally:
            self.streams.closed += 1


async def _server(streams: Streams) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(interceptors=server_interceptors())
    kv_indexer_pb2_grpc.add_KVIndexerServicer_to_server(Indexer(streams), server)
    flow_control_pb2_grpc.add_FlowControlServicer_to_server(Flow(streams), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _open(channel: grpc.aio.Channel, shape: str):  # type: ignore[no-untyped-def]
    if shape == "server-stream":
        return kv_indexer_pb2_grpc.KVIndexerStub(channel).Watch(kv_indexer_pb2.WatchRequest(), metadata=(TRACEPARENT,))
    call = flow_control_pb2_grpc.FlowControlStub(channel).Admit(metadata=(TRACEPARENT,))
    return call


async def _settle() -> None:
    for _ in range(5):  # unclosed async generators are finalized in later tasks: let them run
        gc.collect()
        await asyncio.sleep(0.02)


def _detach_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "detach" in r.getMessage().lower() or r.exc_info]


@pytest.mark.parametrize("shape", ["server-stream", "bidi"])
async def test_client_cancel_closes_the_stream_in_its_task(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    streams = Streams()
    server, address = await _server(streams)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(5):
                async with grpc.aio.insecure_channel(address) as channel:
                    call = _open(channel, shape)
                    assert (await call.read()) is not grpc.aio.EOF
                    call.cancel()
                await _settle()
        assert _detach_failures(caplog) == []
        assert streams.closed == 5  # every generator closed (its finally ran), none left to the finalizer
    finally:
        await server.stop(0)


@pytest.mark.parametrize("shape", ["server-stream", "bidi"])
async def test_server_stop_closes_open_streams_in_their_task(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    streams = Streams()
    with caplog.at_level(logging.WARNING):
        for _ in range(4):  # without the fix about one round in two logged the failure
            server, address = await _server(streams)
            async with grpc.aio.insecure_channel(address) as channel:
                calls = [_open(channel, shape) for _ in range(3)]
                for call in calls:
                    assert (await call.read()) is not grpc.aio.EOF
                await server.stop(0)
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError):
                        while (await call.read()) is not grpc.aio.EOF:
                            pass
            await _settle()
    assert _detach_failures(caplog) == []
    assert streams.closed == 12
