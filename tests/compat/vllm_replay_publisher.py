"""Runs vLLM 0.32's own ``ZmqEventPublisher`` (no engine) for ``test_vllm_replay.py``; run by ``.venv-vllm``'s python.

Usage: ``vllm_replay_publisher.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC COUNT BUFFER_STEPS``. Publishes ``COUNT``
batches (batch ``i``: one ``BlockStored`` of block hash ``i``, ``ts = 1000.0 + i``), waits until its publisher
thread has sent and buffered them all, prints ``ready``, then serves replay requests until stdin closes.
"""

from __future__ import annotations

import sys

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def main() -> None:
    pub_endpoint, replay_endpoint, topic, count, buffer_steps = sys.argv[1:6]
    pub = ZmqEventPublisher(
        0, endpoint=pub_endpoint, replay_endpoint=replay_endpoint, topic=topic, buffer_steps=int(buffer_steps)
    )
    for i in range(int(count)):
        stored = BlockStored(
            block_hashes=[i], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
            lora_id=None, medium="GPU", lora_name=None,
        )
        pub.publish(KVEventBatch(ts=1000.0 + i, events=[stored]))
    pub._event_queue.join()  # every batch sent and in the replay buffer
    print("ready", flush=True)
    sys.stdin.read()
    pub.shutdown()


if __name__ == "__main__":
    main()
