"""The ``lm://`` listener under hostile or careless clients, over real loopback sockets: memory is
committed as PUT bytes arrive and charged to the shared put budget, connections are capped, replies
have write back-pressure, a refused PUT keeps its connection (LMCache's ``LMCServerConnector`` never
reconnects), and a cancelled request never drops a value moving down the tiers. Frames are lmcache
0.5.6's (``lmcache/v1/protocol.py``)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
import uvloop

from services.kv_store.flow import ByteBudget
from services.kv_store.lmcache_protocol import (
    REPLY_BYTES,
    REQUEST,
    LmCacheKey,
    LmCommand,
    LmRequest,
    LmReturnCode,
    ValueMeta,
    decode_reply,
    encode_envelope,
    encode_request,
)
from services.kv_store.lmcache_server import FIRST_SEGMENT_BYTES, WRITE_HIGH_WATER_BYTES, LmcacheServer
from services.kv_store.store import BlockStore
from services.kv_store.tiers.cpu import CpuTier

MIB = 1 << 20
KEY = LmCacheKey("tiny", 1, 0, 0xBEEF, "bfloat16")


def frame(command: LmCommand, key: LmCacheKey = KEY, meta: ValueMeta | None = None) -> bytes:
    return encode_request(LmRequest(command, key, meta or ValueMeta(0)))


def raw_header(command: int, length: int = 0, key: bytes = b"tiny@1@0@beef@bfloat16", fmt: int = 5, dtype: int = 6) -> bytes:
    return REQUEST.pack(command, length, fmt, dtype, 0, length, 0, 0, 0, key.ljust(150))


async def reply(reader: asyncio.StreamReader) -> tuple[LmReturnCode, bytes]:
    head = decode_reply(await asyncio.wait_for(reader.readexactly(REPLY_BYTES), 5))
    payload = await reader.readexactly(head.meta.length) if head.code is LmReturnCode.SUCCESS else b""
    return head.code, payload


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def until(check, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_put_headers_commit_memory_only_as_bytes_arrive_and_share_the_budget() -> None:
    """50 connections announce ~8 MiB PUTs and send nothing more: each holds one first segment
    (64 KiB), charged to the shared budget; closing them gives it all back."""
    store = BlockStore([CpuTier(1 << 30)])
    budget = ByteBudget(1 << 30)
    server = LmcacheServer(store, budget=budget)
    port = await server.start("127.0.0.1", 0)
    before = rss_bytes()
    writers = []
    try:
        for _ in range(50):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(frame(LmCommand.PUT, meta=ValueMeta.binary(8 * MIB - 64)))
            writers.append(writer)
        await until(lambda: budget.in_use >= 50 * FIRST_SEGMENT_BYTES)
        await asyncio.sleep(0.2)
        assert budget.in_use == 50 * FIRST_SEGMENT_BYTES  # not 50 x 8 MiB
        assert rss_bytes() - before < 64 * MIB  # was +410 MB with buffers of the announced size
        for writer in writers:
            writer.close()
        await until(lambda: budget.in_use == 0)
    finally:
        await server.stop()
    assert server.stats.protocol_errors == {"truncated": 50}


async def test_lm_put_waits_for_the_shared_budget_and_is_discarded_when_it_never_comes() -> None:
    store = BlockStore([CpuTier(64 * MIB)])
    budget = ByteBudget(512 * 1024)
    server = LmcacheServer(store, budget=budget, budget_wait_s=0.3)
    port = await server.start("127.0.0.1", 0)
    try:
        # a gRPC Put (or anything else) holds most of the budget
        await budget.acquire(500 * 1024)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = bytes(range(256)) * 1024  # 256 KiB: its second segment does not fit
        writer.write(frame(LmCommand.PUT, meta=ValueMeta.binary(len(payload))) + payload)
        writer.write(frame(LmCommand.GET))
        # no room within 0.3 s: the rest of the PUT is read and dropped, the GET after it is answered (a miss)
        assert await reply(reader) == (LmReturnCode.FAIL, b"")
        assert server.stats.protocol_errors == {"busy": 1}
        assert budget.in_use == 500 * 1024  # the discarded PUT gave back what it held
        budget.release_now(500 * 1024)
        # with room, the same PUT is stored and served on the same connection
        writer.write(frame(LmCommand.PUT, meta=ValueMeta.binary(len(payload))) + payload + frame(LmCommand.GET))
        assert await reply(reader) == (LmReturnCode.SUCCESS, payload)
        await until(lambda: budget.in_use == 0)
        writer.close()
    finally:
        await server.stop()


async def test_refused_put_keeps_the_connection_and_it_serves_a_get() -> None:
    """An oversize PUT, a PUT with a bad field or key, a GET with a bad key: counted by reason, the
    payload skipped, the connection kept (the LMCache client never reconnects)."""
    store = BlockStore([CpuTier(1 * MIB)])
    server = LmcacheServer(store)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        big = b"o" * (2 * MIB)
        writer.write(raw_header(1, len(big)) + big)  # over the 1 MiB tier
        writer.write(raw_header(1, 10, fmt=99) + b"f" * 10)  # unknown memory format
        writer.write(raw_header(1, 10, dtype=77) + b"d" * 10)  # unknown dtype
        writer.write(raw_header(1, 10, key=b"no-at-signs") + b"k" * 10)  # key does not parse
        writer.write(raw_header(1, 10, key=b"\xff\xfe@1@0@ff@half") + b"u" * 10)  # key not UTF-8
        writer.write(raw_header(2, key=b"no-at-signs"))  # a GET with a bad key: FAIL
        writer.write(frame(LmCommand.GET))  # nothing of the refused PUTs was stored
        assert await reply(reader) == (LmReturnCode.FAIL, b"")
        assert await reply(reader) == (LmReturnCode.FAIL, b"")
        writer.write(frame(LmCommand.PUT, meta=ValueMeta.binary(5)) + b"hello" + frame(LmCommand.GET))
        assert await reply(reader) == (LmReturnCode.SUCCESS, b"hello")
        assert server.stats.connections_open == 1
        # framing that cannot be trusted still closes: a negative length, a length past the discard bound
        for header in (raw_header(1, -5), raw_header(1, 2**31 - 1)):
            bad_reader, bad_writer = await asyncio.open_connection("127.0.0.1", port)
            bad_writer.write(header)
            assert await asyncio.wait_for(bad_reader.read(), 5) == b""
            bad_writer.close()
        writer.write(frame(LmCommand.HEALTH))
        assert await reply(reader) == (LmReturnCode.SUCCESS, b"")
        writer.close()
    finally:
        await server.stop()
    assert server.stats.protocol_errors == {"oversize": 2, "bad_field": 2, "bad_key": 3, "bad_length": 1}
    assert server.stats.requests[("put", "refused")] == 5
    assert server.stats.requests[("get", "refused")] == 1
    assert (await store.get(KEY.store_key())).value == encode_envelope(ValueMeta.binary(5)) + b"hello"


async def test_connections_beyond_the_cap_are_closed_and_counted() -> None:
    server = LmcacheServer(BlockStore([CpuTier(MIB)]), max_connections=2)
    port = await server.start("127.0.0.1", 0)
    try:
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for reader, writer in kept:
            writer.write(frame(LmCommand.HEALTH))
            assert await reply(reader) == (LmReturnCode.SUCCESS, b"")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert server.stats.protocol_errors == {"too_many_connections": 1}
        assert server.stats.connections_open == 2
        kept[0][1].close()
        await until(lambda: server.stats.connections_open == 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # room again
        writer.write(frame(LmCommand.HEALTH))
        assert await reply(reader) == (LmReturnCode.SUCCESS, b"")
        writer.close()
        kept[1][1].close()
    finally:
        await server.stop()


async def _pipelined_gets_never_read() -> tuple[int, int, int]:
    """A client sends one PUT of 60 kB and 6000 GETs of it and never reads a reply; returns
    (largest transport write buffer seen, GETs served, GETs sent)."""
    server = LmcacheServer(BlockStore([CpuTier(64 * MIB)]))
    port = await server.start("127.0.0.1", 0)
    gets = 6000
    done = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            value = bytes(60_000)
            sock.sendall(frame(LmCommand.PUT, meta=ValueMeta.binary(len(value))) + value)
            sock.sendall(frame(LmCommand.GET) * gets)  # the kernel buffers what the server does not read
            done.wait(10)

    thread = threading.Thread(target=client, daemon=True)
    try:
        thread.start()
        largest = 0
        for _ in range(100):  # 1 s
            await asyncio.sleep(0.01)
            for connection in server.connections:
                transport = connection._transport
                if transport is not None:
                    largest = max(largest, transport.get_write_buffer_size())
        served = server.stats.requests.get(("get", "hit"), 0)
    finally:
        done.set()
        thread.join(10)
        await server.stop()
    return largest, served, gets


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pipelined_gets_that_are_never_read_leave_the_server_bounded(loop: str) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        largest, served, sent = runner.run(_pipelined_gets_never_read())
    assert largest <= WRITE_HIGH_WATER_BYTES + 60_000 + REPLY_BYTES  # was ~180 MB: every reply buffered
    assert served < sent // 10  # reading stopped while the replies did not drain (~210 here: 4 MiB + socket buffers)


async def test_a_put_payload_that_stalls_closes_its_connection_and_frees_its_budget() -> None:
    budget = ByteBudget(64 * MIB)
    server = LmcacheServer(BlockStore([CpuTier(64 * MIB)]), budget=budget, idle_timeout_s=0.3)
    port = await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(frame(LmCommand.PUT, meta=ValueMeta.binary(4 * MIB)) + bytes(MIB))  # then nothing
        await until(lambda: budget.in_use > 0)
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.1 < time.monotonic() - started < 4
        assert budget.in_use == 0
        assert server.stats.protocol_errors == {"stalled": 1}
        writer.close()
    finally:
        await server.stop()
