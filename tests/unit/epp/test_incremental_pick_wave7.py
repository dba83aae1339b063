"""Issue 10, wave 7: the incremental Pick's remaining per-pick costs cut, each held to what it replaces.

* the exact ASCII byte-level encoder (:mod:`services.epp.tokenization.ascii_bytelevel`): ids and cut
  positions equal HF ``tokenizers``' ``encode`` (the offsets path) for random ASCII texts over the whole
  ASCII range, contractions, whitespace runs and the tokenizer's added tokens and lookalikes; used
  only for the GPT-2-style ByteLevel pre-tokenizer (another pre-tokenizer or a normalizer keeps HF's
  encoder, still with HF's ids); non-ASCII and long texts go to HF;
* :class:`kvmesh.chat_template.TextRope` (a grown chat's text sharing its prefix): length, text, slices,
  ``startswith``/``endswith`` and ``==`` equal the plain string's after any appends, flattening included,
  and the incremental renderer's text with the rope equals the full render and the rope-off text;
* the session-affinity scorer's floor shortcut: the same scores as computing the least queue, for
  random loads, matches and parameters (hypothesis);
* :class:`services.epp.scheduler.RankedFallbacks`: the list ``[s.candidate.endpoint for s in ranked[1:]]``
  under ``len``, indexing, slicing, iteration and ``==``.

The tokenizer is the engine simulator's, the one behind the vLLM 0.32 recordings
(``tests/unit/epp/test_tokenization.py`` replays those through the same encoder).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmesh.chat_template as chat_template
from engine_simulator.tokenizer import CHAT_TEMPLATE, ensure_tokenizer
from kvmesh.chat_template import (
    ChatTemplate,
    IncrementalRenderer,
    TextRope,
    flat,
    render_request,
    rope_append,
    text_slice,
)
from kvmesh.types import Endpoint, EndpointId
from services.epp.framework.cycle_state import CycleState
from services.epp.framework.interfaces import (
    Candidate,
    EndpointMetrics,
    PrefixMatch,
    SchedulingRequest,
    ScoreColumns,
    ScoredCandidate,
)
from services.epp.plugins.prepare.prefix_match import PREFIX_MATCH, TOKEN_IDS
from services.epp.plugins.scorers.session_affinity import SessionAffinityParams, SessionAffinityScorer
from services.epp.scheduler import RankedFallbacks
from services.epp.tokenization.ascii_bytelevel import AsciiByteLevel
from services.epp.tokenization.local import ASCII_MAX_CHARS, LocalTokenizer

# -- the ASCII encoder ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    return LocalTokenizer(ensure_tokenizer(tmp_path_factory.mktemp("tok")))


def _offsets_path(local: LocalTokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = local.tokenizer.encode(text, add_special_tokens=False)
    return enc.ids, [(enc.offsets[i][0], i) for i, t in enumerate(enc.ids) if t in local._cut_ids]


_ascii_piece = st.one_of(
    st.text(st.characters(min_codepoint=0, max_codepoint=127), max_size=6),
    st.sampled_from(["<s>", "</s>", "<unk>", "</s", "<s", "s>", "<<s>>", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d",
                     "'S", "''", "  ", "\n\n", " \n", "\t ", "\r\n", "\x0b", "\x0c", "\x1c", "\x7f", "word", " word",
                     "123", " 4567", "x=1;", "<|user|>\n", "def f(x):\n    return x\n"]),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_ascii_piece, max_size=40).map("".join))
def test_ascii_encoder_equals_hf(tokenizer: LocalTokenizer, text: str) -> None:
    assert tokenizer._ascii is not None  # the simulator's tokenizer is a GPT-2-style byte-level BPE
    assert tokenizer._raw(text) == _offsets_path(tokenizer, text)


def test_ascii_encoder_on_every_ascii_pair(tokenizer: LocalTokenizer) -> None:
    encoder = tokenizer._ascii
    assert encoder is not None
    chars = [chr(i) for i in range(128)]
    texts = [a + b + c for a in chars for b in chars for c in ("", " ", "a", "\n")]
    for text in texts:
        if "<" in text or ">" in text:
            continue  # added-token lookalikes are the hypothesis test's; here: plain chunks only
        assert encoder.encode(text) == tokenizer.tokenizer.encode(text, add_special_tokens=False).ids, repr(text)


def test_non_ascii_and_long_texts_use_hf(tokenizer: LocalTokenizer) -> None:
    for text in ("café </s> naïve 'S", "emoji 😀 </s>\n<s> x", "a" * (ASCII_MAX_CHARS + 5) + " </s> b"):
        assert tokenizer._raw(text) == _offsets_path(tokenizer, text)
    rnd = random.Random(3)
    words = ["the", "cache", "def", "return", " ", "\n", "</s>", "<s>", "'ll", "42", "x.y", "(", ")"]
    for _ in range(50):
        text = "".join(rnd.choice(words) for _ in range(rnd.randint(1, 400)))
        assert tokenizer._raw(text) == _offsets_path(tokenizer, text)


@pytest.mark.parametrize("change", ["prefix_space", "no_regex", "normalizer", "split"])
def test_other_pre_tokenizers_keep_hf(tmp_path: Path, change: str) -> None:
    source = ensure_tokenizer(tmp_path / "tok")
    data = json.loads((source / "tokenizer.json").read_text())
    if change == "prefix_space":
        data["pre_tokenizer"]["add_prefix_space"] = True
    elif change == "no_regex":
        data["pre_tokenizer"]["use_regex"] = False
    elif change == "normalizer":
        data["normalizer"] = {"type": "Lowercase"}
    else:  # Llama 3 / Qwen style: a Split regex, then ByteLevel without its own regex
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\s+|\\w+|[^\\s\\w]+"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    target = tmp_path / "changed"
    target.mkdir()
    (target / "tokenizer.json").write_text(json.dumps(data))
    (target / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    local = LocalTokenizer(target)
    assert local._ascii is None
    for text in ("Hello  World </s> it's 12 cats\n", " x  y\t\tz</s><s>END"):
        assert local._raw(text) == _offsets_path(local, text)


def test_the_encoder_refuses_a_tokenizer_it_does_not_match(tmp_path: Path) -> None:
    source = ensure_tokenizer(tmp_path / "tok")
    local = LocalTokenizer(source)
    data = json.loads((source / "tokenizer.json").read_text())
    assert AsciiByteLevel.for_tokenizer(local.tokenizer, data) is not None
    data["pre_tokenizer"]["add_prefix_space"] = True  # the file says otherwise than the loaded tokenizer does
    assert AsciiByteLevel.for_tokenizer(local.tokenizer, data) is None


# -- the rope ----------------------------------------------------------------------------------------

_chunk = st.text(st.sampled_from("ab\n<>é"), max_size=12)


@settings(max_examples=300, deadline=None)
@given(_chunk, st.lists(_chunk, max_size=80), st.data())
def test_rope_equals_the_string(base: str, pieces: list[str], data: st.DataObject) -> None:
    text: Any = base
    plain = base
    for piece in pieces:
        text = rope_append(text, piece)
        plain += piece
        assert len(text) == len(plain)
    assert flat(text) == plain and str(text) == plain and text == plain and plain == text
    assert flat(text, "TAIL") == plain + "TAIL"
    if isinstance(text, TextRope):
        assert text._depth <= chat_template.ROPE_MAX_DEPTH
        n = len(plain)
        start = data.draw(st.integers(0, n + 2))
        stop = data.draw(st.one_of(st.none(), st.integers(0, n + 2)))
        assert text.slice(start, stop) == plain[start:stop]
        assert text_slice(text, start) == plain[start:]
        probe = data.draw(st.integers(0, n))
        assert text.startswith(plain[:probe]) and text.endswith(plain[n - probe:])
        assert not text.startswith(plain + "x") and not text.endswith("x" + plain)
        assert text != plain + "x" and text == TextRope(plain[: n // 2], plain[n // 2:])


def test_rope_flattens_past_its_depth() -> None:
    text: Any = "base"
    for i in range(chat_template.ROPE_MAX_DEPTH * 3 + 1):
        text = rope_append(text, str(i))
    assert (not isinstance(text, TextRope)) or text._depth <= chat_template.ROPE_MAX_DEPTH
    assert rope_append(text, "") is text


def test_renderer_text_with_and_without_the_rope() -> None:
    template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    with_rope, without = IncrementalRenderer(template), IncrementalRenderer(template)
    without.rope = without.identity_scan = False
    rnd = random.Random(5)
    chat: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    grown = 0
    for turn in range(80):
        chat = [*chat, {"role": "user", "content": f"question {turn} " * rnd.randint(1, 9)}]
        body = {"messages": chat, "add_generation_prompt": turn % 3 != 0}
        expected = render_request(template, body)
        head, tail, base = with_rope.render_parts(body)
        grown += isinstance(head, TextRope)
        assert flat(head, tail) == expected == with_rope.render(body) == without.render(body)
        if base is not None:
            assert head.startswith(flat(base))
        chat = [*chat, {"role": "assistant", "content": f"answer {turn}"}]
    assert grown > 40  # most calls share their prefix


# -- session affinity's floor shortcut ---------------------------------------------------------------

_load = st.tuples(st.integers(0, 50_000), st.integers(0, 6), st.integers(0, 6), st.integers(0, 80))


@settings(max_examples=300, deadline=None)
@given(st.lists(_load, min_size=1, max_size=12), st.integers(1, 40), st.integers(0, 5000),
       st.floats(0.05, 1.0), st.floats(0, 5), st.integers(0, 4096))
def test_floor_shortcut_gives_the_same_scores(loads: list[tuple[int, int, int, int]], total: int, prompt: int,
                                              fraction: float, factor: float, busy: int) -> None:
    candidates = []
    matched = {}
    for i, (queued, known, unknown, blocks) in enumerate(loads):
        eid = EndpointId(f"e{i}")
        metrics = EndpointMetrics(unprefilled_requests=known + unknown, known_unprefilled_requests=known,
                                  queued_prefill_tokens=queued, block_size_tokens=16)
        candidates.append(Candidate(Endpoint(id=eid, url=f"http://e{i}", model="m", block_size_tokens=16), metrics))
        if blocks:
            matched[eid] = min(blocks, total)
    state = CycleState()
    state.set(PREFIX_MATCH, PrefixMatch(total, matched))
    state.set(TOKEN_IDS, list(range(prompt)))
    request = SchedulingRequest(model="m")
    params = SessionAffinityParams(min_match_fraction=fraction, busy_history_factor=factor, busy_tokens=busy)
    fast, slow = SessionAffinityScorer("a", params), SessionAffinityScorer("b", params)
    slow.floor_shortcut = False
    assert fast.score(state, request, candidates) == slow.score(state, request, candidates)


# -- lazy fallbacks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_ranked_fallbacks_are_the_list(n: int) -> None:
    endpoints = [Endpoint(id=EndpointId(f"e{i}"), url=f"http://e{i}", model="m") for i in range(n)]
    columns = ScoreColumns((), ())
    ranked = ScoredCandidate.rows([Candidate(e) for e in endpoints], [float(-i) for i in range(n)], columns)
    lazy = RankedFallbacks(ranked)
    plain = [s.candidate.endpoint for s in ranked[1:]]
    assert len(lazy) == len(plain) and list(lazy) == plain and lazy == plain and plain == lazy
    assert lazy[:2] == plain[:2] and lazy[1:] == plain[1:] and lazy[::-1] == plain[::-1]
    for i in range(-len(plain), len(plain)):
        assert lazy[i] == plain[i]
    for bad in (len(plain), -len(plain) - 1):
        with pytest.raises(IndexError):
            lazy[bad]
    assert lazy != [*plain, endpoints[0] if endpoints else None] and repr(lazy) == repr(plain)
