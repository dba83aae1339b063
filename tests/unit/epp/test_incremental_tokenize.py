"""Issue 10, wave 6: a grown chat shares its history instead of rebuilding it, with the same tokens.

* :class:`kvmesh.hashing.GrowingTokenIds` (a cached chat's ids as a shared base plus a tail, block keys
  memoised and carried across splices): equal to the plain list and to :func:`block_keys` after any
  sequence of splices (at the end, in the tail, deep in the base, flattening), every key space and
  slice (hypothesis);
* epp's in-process tokenizer reusing the last call's messages, text and ids: at every step of chats
  that grow by a turn, by a tool exchange (verbatim messages), edit an earlier message, change the
  system prompt, shrink back (a retry), interleave with a new session sharing the system prompt, the
  ids equal the engine simulator's (held to vLLM 0.32) and a fresh full tokenization; the size bound
  (``max_prompt_chars``) is exactly :func:`prompt_chars`'s on the reuse path too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmesh.hashing as hashing
from engine_simulator.rendering import Renderer
from engine_simulator.tokenizer import synthetic_corpus
from kvmesh.chat_template import render_request
from kvmesh.hashing import GrowingTokenIds, PrefixKeyCache, block_keys
from services.epp.framework.interfaces import ChatMessage, SchedulingRequest
from services.epp.tokenization.in_process import InProcessTokenizer
from services.epp.tokenization.local import LocalTokenizer
from services.epp.tokenize_client import TokenizeSkipped, prompt_chars

_splice = st.tuples(st.floats(0, 1), st.lists(st.integers(0, 2**32 - 1), max_size=40), st.sampled_from([1, 3, 4]),
                    st.sampled_from([0, 77]))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 9), min_size=0, max_size=60), st.lists(_splice, min_size=1, max_size=25),
       st.sampled_from([16, 100_000]))
def test_growing_ids_equal_the_list_and_their_keys_block_keys(start: list[int], ops: list[Any], flat: int) -> None:
    saved = hashing._FLAT_TAIL
    hashing._FLAT_TAIL = flat  # 16 bytes: nearly every splice flattens; 100k: tails grow
    try:
        cache = PrefixKeyCache(max_bytes=4096)
        ids = GrowingTokenIds.build(start)
        model = list(start)
        for fraction, new, block, parent in ops:
            keep = int(fraction * len(model))
            ids, model = ids.spliced(keep, new), model[:keep] + new
            assert ids == model and len(ids) == len(model) and list(ids) == model and ids.tolist() == model
            assert ids.tobytes() == hashing.token_bytes(model)
            assert cache.block_keys(ids, block, parent) == block_keys(model, block, parent)
            assert block_keys(ids, block, parent) == block_keys(model, block, parent)
            if model:
                i = keep % len(model)
                assert ids[i] == model[i] and ids[-1] == model[-1]
                assert ids[keep // 2: keep + 3] == model[keep // 2: keep + 3] and ids[::3] == model[::3]
    finally:
        hashing._FLAT_TAIL = saved


def test_growing_ids_hash_only_their_new_blocks() -> None:
    cache = PrefixKeyCache()
    history = list(range(64 * 100 + 5))
    ids = GrowingTokenIds.build(history)
    assert cache.block_keys(ids, 64) == block_keys(history, 64) and cache.hashed_blocks == 99
    grown = ids.spliced(64 * 100 + 2, list(range(10**6, 10**6 + 64 * 3)))  # the generation prompt replaced
    assert cache.block_keys(grown, 64) == block_keys(grown.tolist(), 64)
    assert (cache.reused_blocks, cache.hashed_blocks) == (100, 102)  # only the 3 new blocks were hashed
    assert grown._base is ids._base  # and the history's bytes were not copied
    edited = grown.spliced(64 * 10 + 1, [5])  # an early edit: a new, flat base
    assert cache.block_keys(edited, 64) == block_keys(edited.tolist(), 64) and edited._base is not ids._base


def _request(messages: list[dict[str, Any]]) -> SchedulingRequest:
    plain = all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
    if plain:
        return SchedulingRequest(model="m", messages=tuple(ChatMessage(m["role"], m["content"]) for m in messages))
    return SchedulingRequest(model="m", render={"messages": json.loads(json.dumps(messages))})  # fresh objects


async def _check(tokenizer: InProcessTokenizer, reference: LocalTokenizer, engine: Renderer,
                 messages: list[dict[str, Any]]) -> None:
    request = _request(messages)
    ids = await tokenizer.tokenize(request, [])
    body = {"messages": messages}
    expected = reference.encode_text(render_request(reference.template, body), add_special_tokens=False)  # type: ignore[arg-type]
    assert ids == expected == engine.chat_request_ids(body)
    chars = prompt_chars(request)  # the size bound is exact on the reuse path too
    strict = InProcessTokenizer({"m": str(reference.path)}, None, max_prompt_chars=chars - 1)
    strict._loaded = tokenizer._loaded
    strict._seen = tokenizer._seen
    with pytest.raises(TokenizeSkipped, match="exceeds"):
        await strict.tokenize(_request(messages), [])


async def test_chats_that_grow_edit_and_branch_keep_the_engines_tokens(tok_dir: Path, engine: Renderer) -> None:
    tokenizer = InProcessTokenizer({"m": str(tok_dir)}, None, max_prompt_chars=1 << 30)
    reference = LocalTokenizer(tok_dir)
    rng = random.Random(11)
    docs = synthetic_corpus(documents=80)
    system = {"role": "system", "content": "You are an agent."}
    chat: list[dict[str, Any]] = [system, {"role": "user", "content": rng.choice(docs)}]
    await _check(tokenizer, reference, engine, chat)  # a session seen for the first time
    for _turn in range(6):  # grown by one turn
        chat += [{"role": "assistant", "content": rng.choice(docs)}, {"role": "user", "content": rng.choice(docs)}]
        await _check(tokenizer, reference, engine, chat)
    assert tokenizer.seen_stats["reused"] >= 6
    local = tokenizer.local("m")
    assert local is not None and local.stats["incremental"] >= 5
    call = {"id": "c1", "type": "function", "function": {"name": "run", "arguments": "{\"cmd\": \"ls\"}"}}
    for _turn in range(3):  # a tool exchange: verbatim messages from here on
        chat += [{"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "c1", "content": rng.choice(docs)}]
        await _check(tokenizer, reference, engine, chat)
    reused = tokenizer.seen_stats["reused"]
    chat += [{"role": "user", "content": "and now?"}]
    await _check(tokenizer, reference, engine, chat)
    assert tokenizer.seen_stats["reused"] == reused + 1  # the verbatim chat's size reused too
    edited = [dict(m) for m in chat]
    edited[3]["content"] = "an edited reply"  # a turn that edits history
    await _check(tokenizer, reference, engine, edited)
    await _check(tokenizer, reference, engine, [{"role": "system", "content": "Another system prompt."}, *chat[1:]])
    await _check(tokenizer, reference, engine, chat[:5])  # a retry of an earlier prefix (shrunk)
    other = [system, {"role": "user", "content": rng.choice(docs)}]  # a new session, same system prompt
    for _turn in range(3):
        await _check(tokenizer, reference, engine, other)
        other += [{"role": "assistant", "content": rng.choice(docs)}, {"role": "user", "content": rng.choice(docs)}]
        chat += [{"role": "assistant", "content": rng.choice(docs)}, {"role": "user", "content": rng.choice(docs)}]
        await _check(tokenizer, reference, engine, chat)  # interleaved with the first session


async def test_sharing_off_gives_the_same_tokens(tok_dir: Path, engine: Renderer) -> None:
    on = InProcessTokenizer({"m": str(tok_dir)}, None, max_prompt_chars=1 << 30)
    off = InProcessTokenizer({"m": str(tok_dir)}, None, max_prompt_chars=1 << 30)
    off.remember_chats = False
    off_local = off.local("m")
    assert off_local is not None
    off_local.share_growth = False
    rng = random.Random(5)
    docs = synthetic_corpus(documents=40)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": rng.choice(docs)}]
    for _turn in range(8):
        a, b = await on.tokenize(_request(chat), []), await off.tokenize(_request(chat), [])
        assert a == b == engine.chat_ids(chat)
        assert isinstance(a, GrowingTokenIds)
        chat += [{"role": "assistant", "content": rng.choice(docs)}, {"role": "user", "content": rng.choice(docs)}]
    assert off.seen_stats == {"reused": 0, "built": 0} and on.seen_stats["reused"] == 7


@settings(max_examples=300, deadline=None)
@given(st.text("ab<", max_size=30), st.text("ab<", max_size=6), st.text("ab<", max_size=30), st.text("ab<", max_size=6),
       st.booleans())
def test_common_prefix_of_parts_equals_that_of_the_joined_texts(a1: str, a2: str, b1: str, b2: str, grown: bool) -> None:
    from services.epp.tokenization.local import _common_prefix, _common_prefix_parts

    if grown:  # b1 built by appending to a1 (what the renderer reports)
        b1 = a1 + b1
    assert _common_prefix_parts(a1, a2, b1, b2, grown) == _common_prefix(a1 + a2, b1 + b2)
