"""Issue 10's incremental-Pick levers, each held to the full computation it shortcuts.

* ``PrefixReplica``'s walk reuse (a prompt extending the last one walks only its new blocks while no
  key was removed): equal to a fresh ``longest_prefix_matches`` over the replica's table after any
  sequence of stores, removals (whole, or one medium of two), endpoint clears, list changes, prompts
  that extend, shrink or branch, and candidate subsets (hypothesis);
* the static generation prompt (:func:`kvmesh.chat_template._static_generation_prompt`): proved only
  for templates whose ``add_generation_prompt`` output cannot depend on the messages; where proved,
  the incremental renderer renders a grown chat's window once and still equals the full render, for
  every root (tools, kwargs such as ``enable_thinking`` or ``add_generation_prompt`` itself);
* the tokenizer's offset-free encoding: ids and cut positions equal the offsets path's, for texts
  full of added tokens, partial ones and lookalikes (hypothesis).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_simulator.tokenizer import CHAT_TEMPLATE, ensure_tokenizer
from kvmesh.chat_template import ChatTemplate, IncrementalRenderer, _static_generation_prompt, render_request
from kvmesh.hashing import block_keys
from kvmesh.prefix_index import PrefixReplica, ReplicaEndpoint, longest_prefix_matches
from services.epp.tokenization.local import LocalTokenizer

BS = 4
ENDPOINTS = ["e0", "e1", "e2", "e3"]


def _replica() -> PrefixReplica:
    replica = PrefixReplica()
    replica.set_endpoints(ReplicaEndpoint(e, "m", BS) for e in ENDPOINTS)
    replica.set_status(True, ())
    replica.advance(1, synced=True)
    return replica


_op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(ENDPOINTS), st.sampled_from(["GPU", "CPU"]), st.integers(0, 3),
              st.integers(1, 12)),
    st.tuples(st.just("remove"), st.sampled_from(ENDPOINTS), st.sampled_from(["GPU", "CPU"]), st.integers(0, 3),
              st.integers(0, 12)),
    st.tuples(st.just("clear"), st.sampled_from(ENDPOINTS)),
    st.tuples(st.just("relist"), st.sets(st.sampled_from(ENDPOINTS))),
    st.tuples(st.just("score"), st.integers(0, 3), st.integers(1, 14), st.sets(st.sampled_from(ENDPOINTS))),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_op, min_size=1, max_size=40))
def test_walk_reuse_equals_a_fresh_walk(ops: list[tuple[Any, ...]]) -> None:
    replica = _replica()
    # four prompt families: 0 and 1 share 3 blocks then differ; 2 extends 0; 3 is unrelated
    base = list(range(1000, 1000 + 14 * BS))
    families = [base, base[: 3 * BS] + list(range(5000, 5000 + 11 * BS)), base + list(range(7000, 7000 + 8)),
                list(range(9000, 9000 + 14 * BS))]
    keys = {f: block_keys(p, BS) for f, p in enumerate(families)}
    scored = 0
    for op in ops:
        if op[0] == "store":
            _, e, medium, f, n = op
            replica.apply_delta(e, medium, keys[f][:n], [])
        elif op[0] == "remove":
            _, e, medium, f, i = op
            replica.apply_delta(e, medium, [], keys[f][i:i + 1])
        elif op[0] == "clear":
            replica.clear_endpoint(op[1])
        elif op[0] == "relist":
            replica.set_endpoints(ReplicaEndpoint(e, "m", BS, state="live" if e in op[1] else "draining")
                                  for e in ENDPOINTS)
        else:
            _, f, n, subset = op
            candidates = sorted(subset) or None
            got = replica.score("m", families[f][: n * BS], candidates)
            prompt_keys = keys[f][:n]
            allowed = [e for e in (candidates or ENDPOINTS) if replica.endpoints[e].state == "live"]
            expected = longest_prefix_matches(prompt_keys, replica.tables.get(("m", BS), {}), allowed)
            assert got.matched_blocks == expected, op
            scored += 1
    assert scored or all(op[0] != "score" for op in ops)


def test_walk_reuse_walks_only_the_new_blocks_and_stops_after_a_removal() -> None:
    replica = _replica()
    prompt = list(range(400))
    keys = block_keys(prompt, BS)
    replica.apply_delta("e1", "GPU", keys[:90], [])
    assert replica.score("m", prompt[: 90 * BS]).matched_blocks == {"e1": 90}
    probes = 0
    table = replica.tables[("m", BS)]

    class Counting(dict[int, dict[str, int]]):
        def get(self, key: Any, default: Any = None) -> Any:
            nonlocal probes
            probes += 1
            return super().get(key, default)

    replica.tables[("m", BS)] = Counting(table)
    replica.apply_delta("e1", "GPU", keys[90:95], [])
    probes = 0
    assert replica.score("m", prompt).matched_blocks == {"e1": 95}
    assert probes <= 8  # the first key, then blocks 90..95: not the 95-block walk
    other = prompt[: 20 * BS] + list(range(9000, 9000 + 70 * BS))  # another session, the same first 20 blocks
    replica.apply_delta("e2", "GPU", block_keys(other, BS), [])
    assert replica.score("m", other).matched_blocks == {"e1": 20, "e2": 90}
    replica.apply_delta("e1", "GPU", keys[95:97], [])
    probes = 0
    assert replica.score("m", prompt).matched_blocks == {"e1": 97, "e2": 20}  # e2 new since: walked from 1
    assert probes <= 30  # the first key, e1 from 95, e2 from block 1 to 20: not e1's 97 blocks
    replica.apply_delta("e1", "GPU", [], [keys[10]])  # a removal: the next score walks again
    probes = 0
    assert replica.score("m", prompt).matched_blocks == {"e1": 10, "e2": 20}
    assert probes >= 10  # walked from block 0 again


# -- static generation prompt -----------------------------------------------------------------------

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
STATIC = {"simulator": CHAT_TEMPLATE, "chatml": CHATML}
DYNAMIC = {
    # the generation prompt reads the last message
    "reads-messages": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                       "{% if add_generation_prompt %}{{ 'reply to ' + messages[-1]['role'] }}{% endif %}"),
    # state set in the loop
    "reads-state": ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m['content'] }}\n"
                    "{% endfor %}{% if add_generation_prompt %}{{ ns.n }}{% endif %}"),
    # output after the generation prompt
    "not-last": ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
                 "{{ messages|length }}"),
    # an else branch (the no-prompt render has output the prompted one lacks)
    "else": ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% else %}"
             "END{% endif %}"),
    # add_generation_prompt read in the loop too
    "in-loop": ("{% for m in messages %}{{ m['content'] }}{% if loop.last and add_generation_prompt %}!{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}A:{% endif %}"),
    # the clock
    "clock": ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}{{ strftime_now('%S') }}{% endif %}"),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_generation_prompt_is_proved_for_common_shapes(name: str) -> None:
    template = ChatTemplate(STATIC[name], SPECIALS)
    assert _static_generation_prompt(template._template.environment.parse(STATIC[name]))
    assert IncrementalRenderer(template).static_generation


@pytest.mark.parametrize("name", sorted(DYNAMIC))
def test_generation_prompt_reading_anything_dynamic_is_not_static(name: str) -> None:
    template = ChatTemplate(DYNAMIC[name], SPECIALS)
    assert not _static_generation_prompt(template._template.environment.parse(DYNAMIC[name]))
    assert not IncrementalRenderer(template).static_generation


def _chat(n: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(n):
        out.append({"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} </s> <s>"})
    return out


@pytest.mark.parametrize("name", sorted(STATIC) + sorted(DYNAMIC))
def test_single_render_growth_equals_the_full_render_for_every_root(name: str) -> None:
    source = {**STATIC, **DYNAMIC}[name]
    template = ChatTemplate(source, SPECIALS)
    renderer = IncrementalRenderer(template)
    tools = [{"type": "function", "function": {"name": "f"}}]
    roots: list[dict[str, Any]] = [{}, {"tools": tools}, {"chat_template_kwargs": {"enable_thinking": False}},
                                   {"chat_template_kwargs": {"add_generation_prompt": False}}]
    chat = _chat(40)
    for root in roots:
        for n in range(3, len(chat) + 1, 2):
            for agp in (True, False, True):
                body = {**root, "messages": chat[:n], "add_generation_prompt": agp}
                if name == "clock":  # time-dependent output: only check the shape, not the second
                    assert renderer.render(body).startswith(render_request(template, {**body, "add_generation_prompt": False}))
                    continue
                assert renderer.render(body) == render_request(template, body), (root, n, agp)
    if name in STATIC:
        assert renderer.stats["incremental"] > 0


# -- offset-free encoding ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    return LocalTokenizer(ensure_tokenizer(tmp_path_factory.mktemp("tok")))


_piece = st.sampled_from(["<s>", "</s>", "<unk>", "</s", "<s", "s>", "<", ">", "/", " ", "\n", "a", "word", "é",
                          "<|user|>", "<</s>>", "<s></s>"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_piece, max_size=30).map("".join))
def test_offset_free_encoding_equals_the_offsets_path(tokenizer: LocalTokenizer, text: str) -> None:
    assert tokenizer._added_re is not None  # the simulator's added tokens are plain: the fast path runs
    fast = tokenizer._raw(text)
    enc = tokenizer.tokenizer.encode(text, add_special_tokens=False)
    assert fast[0] == enc.ids
    expected = [(enc.offsets[i][0], i) for i, t in enumerate(enc.ids) if t in tokenizer._cut_ids]
    assert fast[1] == expected


def test_encoding_with_stripped_added_tokens_uses_offsets(tmp_path: Path) -> None:
    import json

    source = ensure_tokenizer(tmp_path / "tok")
    data = json.loads((source / "tokenizer.json").read_text())
    for token in data["added_tokens"]:
        if token["content"] == "</s>":
            token["lstrip"] = True
    target = tmp_path / "stripped"
    target.mkdir()
    (target / "tokenizer.json").write_text(json.dumps(data))
    local = LocalTokenizer(target)
    assert local._added_re is None
    text = "hello   </s> again <s>x"
    enc = local.tokenizer.encode(text, add_special_tokens=False)
    assert local._raw(text)[0] == enc.ids
