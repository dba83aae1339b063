"""The KV-event publisher over real ZMQ sockets: direction rule, frames, sequence numbers."""

import time

import msgspec
import pytest
import zmq

from engine_simulator.publisher import NullEventPublisher, ZmqEventPublisher, endpoint_binds, make_publisher
from kvmesh.kv_events import AllBlocksCleared, BlockRemoved, decode_batch, decode_seq
from tests.support import wait_until


@pytest.mark.parametrize(
    ("endpoint", "binds"),
    [
        ("tcp://127.0.0.1:5557", False),
        ("tcp://*:5557", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://[::]:5557", True),
        ("ipc:///tmp/x", True),
        ("inproc://x", True),
    ],
    ids=["plain-connects", "wildcard-host", "wildcard-port", "ipv6-any", "ipc", "inproc"],
)
def test_direction_rule_matches_vllm(endpoint: str, binds: bool) -> None:
    assert endpoint_binds(endpoint) is binds


def _receive(sub: zmq.Socket, publisher: ZmqEventPublisher, n: int) -> list[list[bytes]]:
    """Publish until n messages arrive (a fresh PUB/SUB pair drops messages until subscribed)."""
    got: list[list[bytes]] = []

    def received() -> int:
        publisher.publish([AllBlocksCleared(), BlockRemoved(block_hashes=[2**64 - 1])])
        if sub.poll(20):
            got.append(sub.recv_multipart())
        return len(got)

    wait_until(received, 5, f"{n} messages", until=lambda k: k >= n, interval=0)
    assert len(got) == n
    return got


def test_connects_to_a_bound_subscriber() -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", "kv@127.0.0.1:8000@tiny")
    try:
        assert publisher.bound_endpoint is None
        messages = _receive(sub, publisher, 3)
        seqs = [decode_seq(m[1]) for m in messages]
        assert seqs == sorted(seqs) and seqs[1] == seqs[0] + 1 and seqs[2] == seqs[1] + 1
        topic, _, payload = messages[0]
        assert topic == b"kv@127.0.0.1:8000@tiny"
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 5
        assert batch.events == [AllBlocksCleared(), BlockRemoved(block_hashes=[2**64 - 1])]
        assert msgspec.msgpack.decode(payload)[1][1] == {
            "type": "BlockRemoved",
            "block_hashes": [2**64 - 1],
            "medium": "GPU",
            "group_idx": 0,
        }
    finally:
        publisher.shutdown()
        sub.close(linger=0)


def test_binds_for_wildcards() -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "kv@127.0.0.1:8000@tiny")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        assert publisher.bound_endpoint is not None and publisher.bound_endpoint.startswith(
            "tcp://127.0.0.1:"
        )
        sub.connect(publisher.bound_endpoint)
        _receive(sub, publisher, 1)
    finally:
        publisher.shutdown()
        sub.close(linger=0)


def test_empty_batches_are_not_sent_and_disabled_is_null() -> None:
    assert isinstance(make_publisher("", "127.0.0.1:1", "m"), NullEventPublisher)
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "t")
    try:
        publisher.publish([])
        assert publisher.next_seq == 0
    finally:
        publisher.shutdown()
