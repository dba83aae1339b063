"""Incremental chat-template rendering (issue 10): always exactly the full render, window-rendered only when safe.

``kvmesh.chat_template.IncrementalRenderer`` against ``render_request`` (transformers' rendering as vLLM
0.32 calls it) on the simulator's shipped template, templates shaped like the common model families
(ChatML, Llama 3, Qwen 2.5 tool grouping, Llama 2 / Mistral alternation) and adversarial ones
(numbering by ``loop.index``, a counter, ``messages|length``, a late ``loop.index0`` threshold,
output special to the last message, and a Qwen 3-style reverse scan for the last user query that
decides which assistant turns show their reasoning). Hypothesis found the last kind escaping the
window checks (a tool chain longer than the window), hence the static whole-history scan.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_simulator.tokenizer import CHAT_TEMPLATE
from kvmesh.chat_template import ChatTemplate, IncrementalRenderer, _position_hazards, render_request
from kvmesh.errors import InvalidRequest

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set system = 'default system' %}{% set loop_messages = messages %}"
    "{% endif %}<|start_header_id|>system<|end_header_id|>\n\n{{ system }}<|eot_id|>"
    "{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for message in loop_messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}{% if message.tool_calls %}{% for c in message.tool_calls %}"
    "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN25_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0].content if messages[0].role == 'system' else 'default' }}"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role != 'system' %}<|im_start|>system\ndefault<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{%- if not (message.role == 'system' and tools) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role == 'system' %}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for c in message.tool_calls %}\n<tool_call>{{ c.function | tojson }}</tool_call>{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
ALTERNATING = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set sys = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set sys = false %}{% endif %}"
    "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and sys != false %}{% set content = '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
LAST_REASONING = (  # a reasoning template: the reasoning of assistant turns after the last user query only
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set i = (messages|length - 1) - loop.index0 %}"
    "{%- if m.role == 'user' and ns.last_query == messages|length - 1 %}{%- set ns.last_query = i %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_query and (loop.last or message.reasoning_content) %}"
    "<think>{{ message.reasoning_content or '' }}</think>{%- endif %}{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
SHIPPED = {"simulator": CHAT_TEMPLATE, "chatml": CHATML, "llama3": LLAMA3, "qwen25-tools": QWEN25_TOOLS,
           "alternating": ALTERNATING}

NUMBERED = ("{% for m in messages %}Turn {{ loop.index }} {{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
COUNTER = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.n = ns.n + 1 %}{% endif %}"
           "[{{ ns.n }}] {{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
LAST_SPECIAL = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last and m.role == 'assistant' %}<final>"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
LENGTH = "{{ messages|length }} messages\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
LATE = ("{% for m in messages %}{% if loop.index0 > 40 %}(late) {% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
ADVERSARIAL = {"numbered": NUMBERED, "counter": COUNTER, "last-special": LAST_SPECIAL, "length": LENGTH, "late": LATE,
               "last-reasoning": LAST_REASONING}
WHOLE_HISTORY = {"counter", "last-reasoning"}  # state computed over every message: a reverse scan, a counter

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
_text = st.lists(st.sampled_from([*"ab \n<>|/sé", "<s>", "</s>", "<|im_end|>"]), max_size=8).map("".join)


def _message(draw: Any, role: str, i: int) -> dict[str, Any]:
    if role == "tool":
        return {"role": "tool", "tool_call_id": f"c{i}", "content": draw(_text)}
    if role == "assistant" and draw(st.booleans()):
        return {"role": "assistant", "content": draw(st.one_of(st.none(), _text)), "reasoning": draw(_text),
                "tool_calls": [{"id": f"c{i}", "type": "function",
                                "function": {"name": "lookup", "arguments": f'{{"q": "{i}"}}'}}]}
    if role == "user" and draw(st.booleans()):
        return {"role": "user", "content": [{"type": "text", "text": draw(_text)}, {"type": "text", "text": "x"}]}
    return {"role": role, "content": draw(_text)}


@st.composite
def growing_chats(draw: Any, alternate: bool) -> tuple[list[dict[str, Any]], list[tuple[int, bool]]]:
    """A chat of up to ~40 messages and its growth steps: (messages so far, add_generation_prompt)."""
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_text)})
    roles = ["user", "assistant"] if alternate else ["user", "assistant", "tool", "system"]
    total = draw(st.integers(8, 40))
    for i in range(total):
        role = roles[i % 2] if alternate else draw(st.sampled_from(roles))
        messages.append(_message(draw, role, i))
    steps, at = [], 1
    while at < len(messages):
        at = min(len(messages), at + draw(st.integers(1, 4)))
        steps.append((at, draw(st.booleans())))
    return messages, steps


def _full(template: ChatTemplate, body: dict[str, Any]) -> str | type[InvalidRequest]:
    try:
        return render_request(template, body)
    except InvalidRequest:
        return InvalidRequest


def _check_growth(source: str, chat: tuple[list[dict[str, Any]], list[tuple[int, bool]]], tools: Any) -> IncrementalRenderer:
    template = ChatTemplate(source, SPECIALS)
    renderer = IncrementalRenderer(template)
    messages, steps = chat
    for n, agp in steps:
        body = {"messages": messages[:n], "add_generation_prompt": agp, "tools": tools}
        expected = _full(template, body)
        if expected is InvalidRequest:
            with pytest.raises(InvalidRequest):
                renderer.render(body)
            continue
        assert renderer.render(body) == expected, (n, agp)
    if len(messages) > 8:  # a branch: an earlier message edited, then the chat grows again
        edited = [*messages[:5], {"role": "user", "content": "edited"}, *messages[6:]]
        for n in (len(edited) - 1, len(edited)):
            body = {"messages": edited[:n], "tools": tools}
            expected = _full(template, body)
            if expected is not InvalidRequest:
                assert renderer.render(body) == expected
    return renderer


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_kinds_are_incremental(name: str) -> None:
    renderer = IncrementalRenderer(ChatTemplate(SHIPPED[name], SPECIALS))
    assert renderer.incremental, renderer.reason


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_position_dependent_templates_always_render_in_full(name: str) -> None:
    renderer = IncrementalRenderer(ChatTemplate(ADVERSARIAL[name], SPECIALS))
    if name == "last-special":  # the last message's special output is caught per request, by the window check
        assert renderer.incremental
        return
    assert not renderer.incremental
    if name in WHOLE_HISTORY:
        assert renderer.reason.startswith("reads the whole history"), renderer.reason
    else:
        assert renderer.reason.startswith("position-dependent"), renderer.reason


def test_static_scan_allows_the_usual_position_reads() -> None:
    for source in SHIPPED.values():
        ast = ChatTemplate(source, SPECIALS)._template.environment.parse(source)
        assert _position_hazards(ast) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=growing_chats(alternate=False), tools=st.sampled_from([None, TOOLS]))
@pytest.mark.parametrize("name", sorted(set(SHIPPED) - {"alternating"} | set(ADVERSARIAL)))
def test_growing_chats_render_exactly_as_in_full(name: str, chat: Any, tools: Any) -> None:
    _check_growth({**SHIPPED, **ADVERSARIAL}[name], chat, tools)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chat=growing_chats(alternate=True))
@pytest.mark.parametrize("name", ["alternating", "llama3", "chatml", "simulator"])
def test_alternating_chats_render_exactly_as_in_full(name: str, chat: Any) -> None:
    _check_growth(SHIPPED[name], chat, None)


def _plain_chat(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "sys"}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    return messages


def test_an_agent_chat_takes_the_window_path() -> None:
    for name in ("simulator", "qwen25-tools", "llama3"):
        template = ChatTemplate(SHIPPED[name], SPECIALS)
        renderer = IncrementalRenderer(template)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
        for i in range(12):
            messages.append({"role": "assistant", "content": f"step {i}", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": f'{{"i": {i}}}'}}]})
            messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"})
            body = {"messages": list(messages), "tools": TOOLS}
            assert renderer.render(body) == render_request(template, body), (name, i)
        assert renderer.stats["incremental"] >= 8, (name, renderer.stats)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_a_grown_chat_takes_the_window_path(name: str) -> None:
    template = ChatTemplate(SHIPPED[name], SPECIALS)
    renderer = IncrementalRenderer(template)
    messages = _plain_chat(30)
    for n in range(12, len(messages), 2):  # each request ends with the user's new message
        body = {"messages": messages[:n]}
        assert renderer.render(body) == render_request(template, body)
    assert renderer.stats["full"] == 1 and renderer.stats["fallback"] == 0
    assert renderer.stats["incremental"] == len(range(14, len(messages), 2))


def test_anything_but_appending_falls_back() -> None:
    template = ChatTemplate(CHAT_TEMPLATE, SPECIALS)
    renderer = IncrementalRenderer(template)
    messages = _plain_chat(10)
    renderer.render({"messages": messages})
    grown = {"messages": [*messages, {"role": "user", "content": "next"}]}
    assert renderer.render(grown) == render_request(template, grown)
    assert renderer.stats["incremental"] == 1
    variants: list[dict[str, Any]] = [
        {"messages": [*messages[:5], {"role": "user", "content": "edited"}, *messages[6:]]},  # an edit: a miss
        {"messages": messages, "tools": TOOLS},  # other tools: another root
        {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [*messages, {"role": "user", "content": "x"}], "add_generation_prompt": False,
         "continue_final_message": True},
    ]
    for body in variants:
        full_before = renderer.stats["full"]
        assert renderer.render(body) == render_request(template, body)
        assert renderer.stats["full"] == full_before + 1
    assert renderer.stats["incremental"] == 1


def test_last_message_output_falls_back_per_request() -> None:
    template = ChatTemplate(LAST_SPECIAL, SPECIALS)
    renderer = IncrementalRenderer(template)
    messages = _plain_chat(10)  # ends with an assistant turn, rendered with <final> while last
    renderer.render({"messages": messages})
    grown = {"messages": [*messages, {"role": "user", "content": "next"}]}
    assert renderer.render(grown) == render_request(template, grown)
    assert renderer.stats["fallback"] == 1 and renderer.stats["incremental"] == 0


def test_cache_is_bounded_by_bytes() -> None:
    template = ChatTemplate(CHAT_TEMPLATE, SPECIALS)
    renderer = IncrementalRenderer(template, max_bytes=20_000)
    for s in range(40):
        messages = [{"role": "user", "content": f"session {s} " + "w" * 1000}] + _plain_chat(6)[1:]
        renderer.render({"messages": messages})
    assert 0 < renderer._bytes <= 20_000
    assert len(renderer._cache) < 40


ARGS_TOJSON = (  # renders tool-call arguments and tools with tojson, as Llama 3 / Qwen templates do
    "{% if tools %}{{ tools | tojson }}{% endif %}{% for message in messages %}<{{ message['role'] }}>"
    "{{ message['content'] }}{% for c in message.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _tool_turn(arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}


@pytest.mark.parametrize(("first", "then"), [
    ({"a": 1}, {"a": 1.0}), ({"a": 1}, {"a": True}), ({"a": 0.0}, {"a": -0.0}),
    ({"a": 1, "b": 2}, {"b": 2, "a": 1}), ({"a": [1, {"x": 1, "y": 2}]}, {"a": [1, {"y": 2, "x": 1}]}),
])
def test_a_history_equal_in_python_but_rendered_differently_is_rendered_anew(first: Any, then: Any) -> None:
    """``1 == 1.0 == True`` and dicts in other key orders compare equal, yet ``tojson`` renders them apart:
    a cached prefix is reused only for messages equal as rendered (same object or same ``repr``)."""
    assert first == then
    template = ChatTemplate(ARGS_TOJSON, SPECIALS)
    renderer = IncrementalRenderer(template)
    head, tail = _plain_chat(2), _plain_chat(12)  # the edited turn lies far outside the render window
    renderer.render({"messages": [*head, _tool_turn(first), *tail]})
    grown = {"messages": [*head, _tool_turn(then), *tail, {"role": "user", "content": "next"}]}
    assert renderer.render(grown) == render_request(template, grown)
    same = {"messages": [*head, _tool_turn(json_copy(first)), *tail, {"role": "user", "content": "again"}]}
    assert renderer.render(same) == render_request(template, same)  # an equal copy still renders exactly
    assert renderer.stats["incremental"] == 1, renderer.stats


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f"}}],  # keys reordered
    [{"function": {"name": "f", "parameters": {"type": "object"}}, "type": "function"}],
])
def test_tools_in_another_key_order_are_another_root(tools: Any) -> None:
    template = ChatTemplate(ARGS_TOJSON, SPECIALS)
    renderer = IncrementalRenderer(template)
    first = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert first == tools
    messages = _plain_chat(12)
    renderer.render({"messages": messages, "tools": first})
    grown = {"messages": [*messages, {"role": "user", "content": "next"}], "tools": tools}
    assert renderer.render(grown) == render_request(template, grown)


def json_copy(value: Any) -> Any:
    import json

    return json.loads(json.dumps(value))


@pytest.mark.parametrize("arguments", ["[" * 5000 + "]" * 5000, "{not json", "9" * 5000])
def test_tool_call_arguments_that_do_not_decode_render_as_an_empty_object(arguments: str) -> None:
    """A fresh user's HTTP 500: a tool call whose ``arguments`` string nests 5,000 brackets raised
    RecursionError in the engine simulator's renderer; any argument string that does not decode
    (malformed, nested too deeply, an integer past the digit limit) renders as ``{}``."""
    template = ChatTemplate(ARGS_TOJSON, SPECIALS)
    body = {"messages": [{"role": "user", "content": "go"}, _tool_turn(arguments)]}
    assert "<assistant>{}" in render_request(template, body)
