"""Chat requests to prompt text exactly as vLLM 0.32 renders them: message parsing plus HF's jinja rendering. Pure.

One implementation shared by epp (which must key exactly what the engine caches) and the engine
simulator (which must render what vLLM renders). Two stages, each following its upstream:

1. :func:`conversation` — vLLM 0.32 ``vllm/entrypoints/chat_utils.py`` (``_parse_chat_message_content``,
   ``_parse_chat_message_content_parts``, ``_postprocess_messages``), for a text-only model:

   * ``content`` None -> no parts; a string -> one text part; a list -> its parts. Text-like parts
     (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``; a bare string part) keep
     their text; a text/refusal part whose text is None is skipped. With the ``"string"`` content
     format the texts are joined with ``"\\n"`` (so two text parts become ``"a\\nb"``, and None content
     becomes ``""``); with ``"openai"`` they stay ``[{"type": "text", "text": ...}]``.
   * Media parts (``image_url``, ``input_image``, ``audio_url``, ``input_audio``, ``video_url``,
     ``image_embeds``, ``audio_embeds``, ``prompt_embeds``, ``image_pil``) raise
     :class:`MultimodalContent`: their placeholder tokens and multimodal hashes cannot be known
     without the model's processor. Unknown part types raise :class:`~kvmesh.errors.InvalidRequest`.
   * ``assistant``: ``tool_calls`` kept when not None, ``reasoning`` also copied to ``reasoning_content``;
     ``tool``: ``tool_call_id`` kept, list content of only text parts joined with ``"\\n"``; any role:
     a string ``name`` kept; ``developer``: ``tools``. Then every assistant ``tool_calls`` item's
     ``function.arguments`` JSON string is parsed to a dict (invalid or missing -> ``{}``) and an empty
     ``tool_calls`` list is dropped.

2. :class:`ChatTemplate` — transformers' ``render_jinja_template`` (``utils/chat_template_utils.py``),
   which vLLM calls through ``apply_chat_template(tokenize=False)``: a jinja2
   ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with ``loopcontrols``, the
   ``{% generation %}`` tag, ``tojson`` (``json.dumps``, ``ensure_ascii=False``), ``raise_exception``
   and ``strftime_now``; variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
   the tokenizer's special tokens (``bos_token``...) and the request's ``chat_template_kwargs``
   (vLLM keeps only those the template reads or HF's own parameters, and they override the
   top-level fields). ``continue_final_message`` appends a tag to the final message's content, renders,
   and cuts the text at the tag, as transformers does.

:func:`detect_content_format` is vLLM's ``"auto"`` choice: ``"openai"`` when the template loops over a
message's ``content``, else ``"string"``.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from operator import is_
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

from kvmesh.errors import InvalidRequest

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})
MEDIA_PART_TYPES = frozenset({
    "image_url", "input_image", "audio_url", "input_audio", "video_url",
    "image_embeds", "audio_embeds", "prompt_embeds", "image_pil",
})
HF_TEMPLATE_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
"""transformers' ``apply_chat_template`` parameters: vLLM accepts them in ``chat_template_kwargs`` whatever the template reads."""

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class MultimodalContent(InvalidRequest):
    """A message carries a media part: its tokens depend on the model's multimodal processor."""


def _part_text(part: Any, where: str) -> tuple[bool, str | None]:
    """(is text-like, its text) for one content part; raises for media and unknown parts."""
    if isinstance(part, str):
        return True, part
    if not isinstance(part, Mapping):
        raise InvalidRequest(f"{where}: a content part must be an object or a string")
    kind = part.get("type")
    if kind in TEXT_PART_TYPES and part.get("uuid") is None:
        text = part.get("thinking") if kind == "thinking" else part.get("refusal") if kind == "refusal" else part.get("text")
        if text is not None and not isinstance(text, str):
            raise InvalidRequest(f"{where}: the {kind} part's text must be a string")
        return True, text
    if kind in MEDIA_PART_TYPES or (kind is None and any(k in part for k in MEDIA_PART_TYPES)):
        raise MultimodalContent(f"{where}: {kind or 'media'} parts need the model's multimodal processor")
    if kind is None:
        raise InvalidRequest(f"{where}: missing 'type' field in a content part")
    raise InvalidRequest(f"{where}: unsupported chat content part type {kind!r}")


def _parse_arguments(tool_calls: Any) -> Any:
    out = copy.deepcopy(tool_calls)
    for item in out:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            continue
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                function["arguments"] = json.loads(args)
            except (ValueError, RecursionError):  # not JSON, an int past the digit limit, nested too deeply
                function["arguments"] = {}
        elif not isinstance(args, (dict, list)):
            function["arguments"] = {}
    return out


def conversation(messages: Any, content_format: str = "string") -> list[dict[str, Any]]:
    """The conversation vLLM 0.32 hands to the chat template (rules in the module docstring).

    Args:
        messages: the request's ``messages`` (OpenAI shape).
        content_format: ``"string"`` or ``"openai"``.

    Raises:
        MultimodalContent: a media content part.
        InvalidRequest: not a non-empty list of messages with a string ``role``, or a malformed part.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list")
    wrap = content_format == "openai"
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not (type(message) is dict or isinstance(message, Mapping)) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages[{i}] needs a string 'role'")
        role = message["role"]
        content = message.get("content")
        if content is None:
            parts: list[Any] = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, list):
            parts = content
        else:
            raise InvalidRequest(f"messages[{i}].content must be a string, a list of parts or null")
        texts: list[str] = []
        if type(content) is str:
            texts.append(content)
        else:
            for j, part in enumerate(parts):
                _, text = _part_text(part, f"messages[{i}].content[{j}]")
                if text is not None:
                    texts.append(text)
        msg: dict[str, Any] = {"role": role}
        msg["content"] = [{"type": "text", "text": t} for t in texts] if wrap else "\n".join(texts)
        if role == "assistant":
            if message.get("tool_calls") is not None:
                msg["tool_calls"] = list(message["tool_calls"])
            if message.get("reasoning") is not None:
                msg["reasoning"] = msg["reasoning_content"] = message["reasoning"]
        elif role == "tool":
            if "tool_call_id" in message:
                msg["tool_call_id"] = message["tool_call_id"]
            if wrap:  # vLLM flattens a tool message's text parts even in the openai format
                msg["content"] = "\n".join(texts)
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if isinstance(message.get("task"), str):
            msg["task"] = message["task"]
        if role == "developer":
            msg["tools"] = message.get("tools")
        if role == "assistant" and isinstance(msg.get("tool_calls"), list):
            if not msg["tool_calls"]:
                del msg["tool_calls"]
            else:
                msg["tool_calls"] = _parse_arguments(msg["tool_calls"])
        out.append(msg)
    return out


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (renders its body; no mask tracking)."""

    tags = frozenset({"generation"})  # type: ignore[assignment]

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_BUILTIN_METHOD: Any = type({}.get)


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' ``ImmutableSandboxedEnvironment`` with its attribute verdicts memoised.

    Jinja's verdict (``_``-prefixed names, ``is_internal_attribute``, ``modifies_known_mutable``)
    depends only on the object's type and the attribute's name, so it is cached per
    ``(type, name)``: the same answers, without the per-access ``isinstance`` chain that dominated
    rendering a long chat.
    """

    _verdicts: dict[tuple[type, str], bool]

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        """``dict.get`` (``message.get('tool_calls')``: most calls a chat template makes) called directly:
        exactly what the sandbox's path does for it (safe callable, no context argument, no
        ``StopIteration``), without its per-call checks; everything else through the sandbox."""
        if type(obj) is _BUILTIN_METHOD and type(getattr(obj, "__self__", None)) is dict and obj.__name__ == "get":
            kwargs.pop("_block_vars", None)  # the context's bookkeeping (``Context.call`` drops them too)
            kwargs.pop("_loop_vars", None)
            return obj(*args, **kwargs)
        return super().call(context, obj, *args, **kwargs)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = super().is_safe_attribute(obj, attr, value)
            if len(self._verdicts) > 4096:
                self._verdicts.clear()
            self._verdicts[key] = verdict
        return verdict


@lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str], str]:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env._verdicts = {}
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        ast = env.parse(source)
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequest(f"chat template does not parse: {exc}") from exc
    return template, frozenset(jinja2.meta.find_undeclared_variables(ast)), _content_format(ast)


def _is_content_access(node: Any) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return False


def _content_format(ast: jinja2.nodes.Template) -> str:
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content_access(loop.iter):
            return "openai"
    return "string"


def detect_content_format(source: str) -> str:
    """``"openai"`` when the template iterates over a message's ``content`` (vLLM's ``auto``), else ``"string"``."""
    return _compile(source)[2]


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens.

    Args:
        source: the jinja template text.
        special_tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``... (template variables).

    Raises:
        InvalidRequest: the template does not parse.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self._template, self.variables, self.content_format = _compile(source)
        self.special_tokens = dict(special_tokens or {})

    def accepted_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's filter of ``chat_template_kwargs``: keys the template reads or HF's own parameters.

        Raises:
            InvalidRequest: ``chat_template`` or ``tokenize`` among them (vLLM refuses both).
        """
        bad = {"chat_template", "tokenize"} & kwargs.keys()
        if bad:
            raise InvalidRequest(f"Found unexpected chat template kwargs from request: {sorted(bad)}")
        return {k: v for k, v in kwargs.items() if k in self.variables or k in HF_TEMPLATE_PARAMS}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Any = None,
        documents: Any = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for an already parsed :func:`conversation`.

        Raises:
            InvalidRequest: both ``add_generation_prompt`` and ``continue_final_message``, a final
                message without content to continue, or the template raising.
        """
        extra = self.accepted_kwargs(kwargs or {})
        tools = extra.pop("tools", tools)
        documents = extra.pop("documents", documents)
        add_generation_prompt = bool(extra.pop("add_generation_prompt", add_generation_prompt))
        continue_final_message = bool(extra.pop("continue_final_message", continue_final_message))
        for name in HF_TEMPLATE_PARAMS:
            extra.pop(name, None)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        chat: Sequence[Mapping[str, Any]] = messages
        final = ""
        if continue_final_message:
            chat = copy.deepcopy(list(messages))
            last = chat[-1]
            content = last.get("content")
            if content is None:
                raise InvalidRequest('continue_final_message is set but the final message has no "content" to continue!')
            if isinstance(content, list):
                for block in reversed(content):
                    if isinstance(block, dict) and "text" in block:
                        final = block["text"]
                        block["text"] = block["text"] + _CONTINUE_TAG
                        break
                else:
                    raise InvalidRequest("continue_final_message is set but the final message has no text to continue")
            else:
                final = str(content)
                last["content"] = final + _CONTINUE_TAG  # type: ignore[index]
        variables = {**self.special_tokens, **extra}
        try:
            text = self._template.render(
                messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template error: {exc}") from exc
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in text or tag not in text:
                raise InvalidRequest("continue_final_message is set but the final message does not appear in the chat")
            at = text.rindex(tag)
            text = text[:at] if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        return text


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The ``tools`` a vLLM 0.32 template sees: each ``ChatCompletionToolsParam.model_dump()``.

    ``{"type": "function", "function": {"name", "description": None, "parameters": None, ...extras}, ...extras}``:
    pydantic dumps declared fields first (defaults included) then extra keys (``extra="allow"``).

    Raises:
        InvalidRequest: not a list of objects each with a ``function`` object naming a string ``name``.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"tools[{i}].function.name must be a string")
        fn = {"name": function["name"], "description": function.get("description"),
              "parameters": function.get("parameters")}
        fn.update({k: v for k, v in function.items() if k not in fn})
        entry: dict[str, Any] = {"type": tool.get("type", "function"), "function": fn}
        entry.update({k: v for k, v in tool.items() if k not in entry})
        out.append(entry)
    return out


def render_request(template: ChatTemplate, body: Mapping[str, Any], content_format: str = "auto") -> str:
    """The prompt text of a chat request body (``messages`` and the fields that change the rendering).

    Fields read (vLLM 0.32 defaults): ``messages``, ``tools`` (None), ``documents`` (None),
    ``add_generation_prompt`` (True), ``continue_final_message`` (False), ``chat_template_kwargs`` ({}).
    ``tools`` are :func:`normalize_tools`'d. ``chat_template`` is the caller's business (pick the
    template before calling).

    Raises:
        MultimodalContent, InvalidRequest: see :func:`conversation` and :meth:`ChatTemplate.render`.
    """
    fmt = template.content_format if content_format == "auto" else content_format
    conv = conversation(body.get("messages"), fmt)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object")
    tools = normalize_tools(body.get("tools"))
    documents = body.get("documents")
    if documents is not None and not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
        raise InvalidRequest("documents must be a list of objects")
    return template.render(
        conv,
        tools=tools,
        documents=documents,
        add_generation_prompt=bool(body.get("add_generation_prompt", True)),
        continue_final_message=bool(body.get("continue_final_message", False)),
        kwargs=kwargs,
    )


# -- incremental rendering --------------------------------------------------------------------------

_WINDOW_HEAD = 2
"""Leading messages every window keeps (a system message and the first turn: templates read ``messages[0]``,
``messages[1]``, ``loop.first``, ``loop.index0 == 0``)."""
_WINDOW_CONTEXT = 4
_WINDOW_GROWTH = 12
"""Messages a window may grow by before it is re-anchored (a window kept from call to call spares one render)."""
"""Messages before the cached prefix's end that the window also renders (neighbour reads such as
``messages[loop.index0 - 1]``, carried ``namespace`` flags)."""
_GENERATION_ROOTS = 1024
"""Roots (tools, documents, kwargs) whose static generation prompt is kept (cleared when full)."""
_POSITION_ATTRS = frozenset({"index", "index0"})
_UNSAFE_LOOP_ATTRS = frozenset({"length", "cycle", "changed", "previtem", "nextitem"})


def _position_hazards(ast: jinja2.nodes.Node) -> list[str]:
    """Template constructs whose output depends on a message's absolute position (window rendering would shift it).

    Allowed, because a parity- and end-preserving window reproduces them: ``loop.first``, ``loop.last``,
    ``loop.revindex*``, ``loop.index0 % 2``, ``loop.index0 == 0`` (or ``!= 0``, ``loop.index == 1``),
    ``loop.index0`` in arithmetic used as a subscript (``messages[loop.index0 - 1]``) or compared with
    another variable, and ``messages|length`` in a subtraction (a distance from the end). Refused: any
    other ``loop.length``/``cycle``/``changed``/``previtem``/``nextitem``, ``loop.index*`` printed or
    compared with a constant other than 0/1, ``messages|length`` printed or compared with a constant.
    """
    found: list[str] = []

    def is_pos(node: Any) -> bool:
        return (isinstance(node, jinja2.nodes.Getattr) and isinstance(node.node, jinja2.nodes.Name)
                and node.node.name == "loop" and node.attr in _POSITION_ATTRS)

    def is_len(node: Any) -> bool:
        return isinstance(node, jinja2.nodes.Filter) and node.name in {"length", "count"}

    def small_const(node: Any) -> bool:
        return isinstance(node, jinja2.nodes.Const) and node.value in (0, 1)

    def walk(node: Any, parents: tuple[Any, ...]) -> None:
        parent = parents[-1] if parents else None
        if isinstance(node, jinja2.nodes.Getattr) and isinstance(node.node, jinja2.nodes.Name) \
                and node.node.name == "loop" and node.attr in _UNSAFE_LOOP_ATTRS:
            found.append(f"loop.{node.attr} (line {node.lineno})")
        if is_pos(node) or is_len(node):
            what = f"loop.{node.attr}" if is_pos(node) else f"|{node.name}"
            ok = False
            if isinstance(parent, jinja2.nodes.Mod) and parent.left is node:
                ok = True  # parity
            elif isinstance(parent, (jinja2.nodes.Add, jinja2.nodes.Sub)):
                ok = is_len(node) or any(isinstance(p, jinja2.nodes.Getitem) for p in parents) \
                    or isinstance(parent, jinja2.nodes.Sub)  # neighbour subscript / distance from the end
            elif isinstance(parent, jinja2.nodes.Getitem) and parent.arg is node:
                ok = True
            elif isinstance(parent, jinja2.nodes.Compare):
                others = [parent.expr, *(op.expr for op in parent.ops)]
                consts = [o for o in others if isinstance(o, jinja2.nodes.Const)]
                ok = all(small_const(c) for c in consts) and not is_len(node)
            elif isinstance(parent, jinja2.nodes.Operand):
                ok = not isinstance(parent.expr, jinja2.nodes.Const) or small_const(parent.expr)
            if not ok and is_len(node) and not isinstance(node.node, jinja2.nodes.Name):
                ok = True  # the length of something else (a string, a tool list)
            if not ok and is_len(node) and isinstance(node.node, jinja2.nodes.Name) \
                    and node.node.name not in {"messages", "loop_messages"}:
                ok = True
            if not ok:
                found.append(f"{what} (line {node.lineno})")
        for child in node.iter_child_nodes():
            walk(child, (*parents, node))

    walk(ast, ())
    return found


def _history_hazards(ast: jinja2.nodes.Template) -> list[str]:
    """Template constructs whose output for a message can depend on messages outside a short window.

    The message lists are ``messages`` and names set to it or to ``messages[c:]`` (``c`` < 2). Allowed:
    one forward ``for`` over a message list without a filter; subscripts by a constant in the head
    (``[0]``, ``[1]``) or the tail (``[-1]`` .. ``[-4]``) or by an expression of ``loop.index*``
    (neighbours); ``|length`` (judged by :func:`_position_hazards`); ``namespace`` attributes set
    outside that loop. Refused: a second loop over the messages (a reverse scan for the last user
    query, say), a filtered or sliced loop, a ``namespace`` attribute set inside the loop (state
    carried from message to message, unbounded), any other use of a message list (filters such as
    ``selectattr``/``map``, a macro argument, ``in``, printing it).
    """
    seqs = {"messages"}
    for node in ast.find_all(jinja2.nodes.Assign):
        value = node.node
        if isinstance(node.target, jinja2.nodes.Name) and (
            (isinstance(value, jinja2.nodes.Name) and value.name in seqs)
            or (isinstance(value, jinja2.nodes.Getitem) and isinstance(value.node, jinja2.nodes.Name)
                and value.node.name in seqs and isinstance(value.arg, jinja2.nodes.Slice)
                and value.arg.stop is None and value.arg.step is None
                and isinstance(value.arg.start, jinja2.nodes.Const) and value.arg.start.value in (0, 1))
        ):
            seqs.add(node.target.name)
    found: list[str] = []
    loops = [f for f in ast.find_all(jinja2.nodes.For)
             if isinstance(f.iter, jinja2.nodes.Name) and f.iter.name in seqs]
    if len(loops) > 1:
        found.append(f"{len(loops)} loops over the messages (lines {', '.join(str(f.lineno) for f in loops)})")
    for loop in loops:
        if loop.test is not None or loop.recursive:
            found.append(f"a filtered loop over the messages (line {loop.lineno})")
        for assign in loop.find_all(jinja2.nodes.Assign):
            if isinstance(assign.target, jinja2.nodes.NSRef):
                found.append(f"namespace state set in the message loop: {assign.target.name}.{assign.target.attr} "
                             f"(line {assign.lineno})")
    loop_iters = {id(f.iter) for f in loops}

    def allowed_subscript(arg: Any) -> bool:
        if isinstance(arg, jinja2.nodes.Const):
            return isinstance(arg.value, int) and (0 <= arg.value < _WINDOW_HEAD or -_WINDOW_CONTEXT <= arg.value < 0)
        if isinstance(arg, jinja2.nodes.Neg):  # -1 parses as Neg(Const(1)) in some versions
            return isinstance(arg.node, jinja2.nodes.Const) and 0 < arg.node.value <= _WINDOW_CONTEXT
        return any(isinstance(n, jinja2.nodes.Getattr) and isinstance(n.node, jinja2.nodes.Name)
                   and n.node.name == "loop" and n.attr in _POSITION_ATTRS
                   for n in [arg, *arg.find_all(jinja2.nodes.Getattr)])

    def walk(node: Any, parent: Any) -> None:
        if isinstance(node, jinja2.nodes.Name) and node.name in seqs and node.ctx == "load" and id(node) not in loop_iters:
            ok = False
            if isinstance(parent, jinja2.nodes.Getitem) and parent.node is node:
                ok = allowed_subscript(parent.arg) or (
                    isinstance(parent.arg, jinja2.nodes.Slice) and parent.arg.stop is None and parent.arg.step is None
                    and isinstance(parent.arg.start, jinja2.nodes.Const) and parent.arg.start.value in (0, 1))
            elif isinstance(parent, jinja2.nodes.Getattr) and parent.node is node:
                ok = False
            elif isinstance(parent, jinja2.nodes.Filter) and parent.node is node and parent.name in {"length", "count"}:
                ok = True
            elif isinstance(parent, jinja2.nodes.Assign) and parent.node is node:
                ok = True  # an alias (in seqs)
            if not ok:
                found.append(f"{node.name} used as a whole (line {node.lineno})")
        for child in node.iter_child_nodes():
            walk(child, node)

    walk(ast, None)
    return found


_GENERATION_DYNAMIC_NAMES = frozenset({"messages", "loop", "strftime_now", "self", "varargs", "kwargs", "caller"})


def _static_generation_prompt(ast: jinja2.nodes.Template) -> bool:
    """Whether ``render(m, True) == render(m, False) + g`` with ``g`` the same for every ``m`` (given the
    same tools, documents, kwargs and special tokens).

    Proved from the template's shape: ``add_generation_prompt`` is read exactly once, as the whole test
    of an ``if`` without ``elif``/``else`` that is the template's last top-level node (nothing is output
    after it), and that ``if``'s body reads no message list, loop variable, template-assigned name
    (``set``, ``for`` targets, macros, namespaces: they may carry state from the messages) or the clock
    (``strftime_now``). Then the body's output is a function of the request's root fields only, and an
    incremental render can render the new messages once (without the generation prompt) and append
    the ``g`` measured on the first render under the same root. Common templates (ChatML, Llama 3,
    Qwen, the simulator's) end this way; one that does not renders the window twice.
    """
    uses = [n for n in ast.find_all(jinja2.nodes.Name) if n.name == "add_generation_prompt"]
    if len(uses) != 1 or not ast.body:
        return False
    last = ast.body[-1]
    if not isinstance(last, jinja2.nodes.If) or last.test is not uses[0] or last.elif_ or last.else_:
        return False
    assigned = {n.name for n in ast.find_all(jinja2.nodes.Name) if n.ctx in ("store", "param")}
    assigned |= {n.name for n in ast.find_all(jinja2.nodes.Macro)}
    assigned |= {n.name for n in ast.find_all(jinja2.nodes.NSRef)}
    for node in last.body:
        for name in node.find_all(jinja2.nodes.Name):
            if name.name in _GENERATION_DYNAMIC_NAMES or name.name in assigned:
                return False
        if any(True for _ in node.find_all((jinja2.nodes.Assign, jinja2.nodes.AssignBlock, jinja2.nodes.Macro,
                                            jinja2.nodes.CallBlock, jinja2.nodes.Include, jinja2.nodes.Import,
                                            jinja2.nodes.FromImport, jinja2.nodes.ExprStmt))):
            return False
    return True


def _probe_conversations() -> list[tuple[list[dict[str, Any]], Any]]:
    """Messages (OpenAI shape) and ``tools`` covering every role, tool calls, results, reasoning, names and parts."""
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    tools = [{"type": "function", "function": {"name": "lookup", "description": "find",
                                               "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    plain: list[dict[str, Any]] = []
    for i in range(7):
        plain.append({"role": "user", "content": f"question {i}"})
        plain.append({"role": "assistant", "content": f"answer {i}"})
    system = [{"role": "system", "content": "be brief"}, *plain]
    agent: list[dict[str, Any]] = [{"role": "system", "content": "you are an agent"}, {"role": "user", "content": "find x"}]
    for i in range(4):
        agent.append({"role": "assistant", "content": None if i % 2 else f"let me look {i}",
                      "tool_calls": [{**call, "id": f"call_{i}"}], "reasoning": f"thinking {i}"})
        agent.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"result {i}"})
        if i == 1:
            agent.append({"role": "tool", "tool_call_id": "call_x", "content": "second result"})
        agent.append({"role": "assistant", "content": f"so far {i}", "reasoning": f"why {i}"})
        agent.append({"role": "user", "content": [{"type": "text", "text": f"more {i}"}, {"type": "text", "text": "please"}],
                      "name": "bob"})
    return [(plain, None), (system, None), (system, tools), (agent, None), (agent, tools), (plain[:9], tools)]


ROPE_MAX_DEPTH = 32
"""Appended pieces a :class:`TextRope` chains before it is flattened into one string (one history-sized copy
per this many grown calls of a chat, instead of one per call)."""


class TextRope:
    """An immutable text built by appending: ``parent``'s text followed by ``piece``.

    Why: a grown chat's text is the cached prefix's text plus the new turn; built as a ``str`` that is a
    history-sized copy (130 KB at 30k tokens) into freshly allocated memory on every call, and the copy
    plus its page faults cost ~0.05 ms median (far more at the tail) per Pick. A rope shares the prefix:
    appending allocates only the piece and a node. Slices near the end (the tokenizer encodes only the
    new turn) walk back over the last nodes; :meth:`__str__` joins the whole (a full encode, ``render``).
    At most :data:`ROPE_MAX_DEPTH` nodes deep (:func:`rope_append` flattens beyond), so every operation is
    O(depth + the characters it returns). ``==`` compares texts (with ``str`` too); not hashable.
    """

    __slots__ = ("_depth", "_len", "_parent", "_piece", "_start")

    _depth: int
    _len: int
    _start: int

    def __init__(self, parent: str | TextRope, piece: str) -> None:
        self._parent = parent
        self._piece = piece
        self._start = len(parent)
        self._len = self._start + len(piece)
        self._depth = parent._depth + 1 if isinstance(parent, TextRope) else 1

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        return self.joined()

    def joined(self, tail: str = "") -> str:
        """``str(self) + tail`` built in one copy."""
        pieces: list[str] = [tail]
        node: str | TextRope = self
        while isinstance(node, TextRope):
            pieces.append(node._piece)
            node = node._parent
        pieces.append(node)
        return "".join(reversed(pieces))

    def slice(self, start: int, stop: int | None = None) -> str:
        """``str(self)[start:stop]`` (non-negative bounds, as ``str`` clamps them), walking only the nodes it covers."""
        stop = self._len if stop is None or stop > self._len else stop
        if start >= stop:
            return ""
        pieces: list[str] = []
        node: str | TextRope = self
        while isinstance(node, TextRope):
            begin = node._start
            if begin < stop:
                pieces.append(node._piece[max(0, start - begin): stop - begin])
                if begin <= start:
                    break
            node = node._parent
        else:
            pieces.append(node[start:stop])
        return pieces[0] if len(pieces) == 1 else "".join(reversed(pieces))

    def startswith(self, prefix: str) -> bool:
        return len(prefix) <= self._len and self.slice(0, len(prefix)) == prefix

    def endswith(self, suffix: str) -> bool:
        return len(suffix) <= self._len and self.slice(self._len - len(suffix)) == suffix

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, TextRope | str):
            return len(other) == self._len and str(self) == str(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TextRope(len={self._len}, depth={self._depth})"


Text = str | TextRope
"""A rendered chat's text: a ``str``, or a :class:`TextRope` sharing a cached prefix."""


def rope_append(text: Text, piece: str) -> Text:
    """``text + piece`` without copying ``text`` (a :class:`TextRope`; flattened to a ``str`` past :data:`ROPE_MAX_DEPTH`)."""
    if not piece:
        return text
    if isinstance(text, TextRope) and text._depth >= ROPE_MAX_DEPTH:
        return str(text) + piece
    return TextRope(text, piece)


def text_slice(text: Text, start: int, stop: int | None = None) -> str:
    """``text[start:stop]`` as a ``str`` for either form (non-negative bounds)."""
    return text.slice(start, stop) if isinstance(text, TextRope) else text[start:stop]


def flat(text: Text, tail: str = "") -> str:
    """``text + tail`` as one ``str`` (one copy for a :class:`TextRope`; ``text`` itself for a ``str`` and no tail)."""
    if isinstance(text, str):
        return text + tail if tail else text
    return text.joined(tail)


class IncrementalRenderer:
    """:meth:`ChatTemplate.render` for chats that grow by appending messages, rendering only the new ones.

    Design: the cache keeps, per message prefix ``m[:k]`` (found by :func:`prefix_key` under a root of
    ``tools``/``documents``/``chat_template_kwargs``; verified by comparing the root and the messages
    themselves), ``R_k = render(m[:k], add_generation_prompt=False)``. A request ``m[:n]`` that extends
    a cached prefix is rendered as ``R_k + B[len(A):]`` where ``A``/``B`` render a short *window*
    ``m[:2] + m[j:k]`` / ``m[:2] + m[j:n]`` (:func:`_window_start`: ``j <= k - 4``, ``j - 2`` even so
    ``loop.index0`` keeps its parity, preferably after a message of ``m[1]``'s role; ``loop.first``/
    ``last``/``revindex``, ``messages[0]``, ``messages[-1]`` and neighbour reads keep their meaning; the
    previous call's window is kept, and its text reused as ``A``, until it grows by 12 messages); the
    generation prompt is ``render(W, True)`` minus ``B`` (for a template whose generation prompt is
    proved static, :attr:`static_generation`, the text measured on the first render under the same
    root, so a grown chat's window is rendered once). Checked on every request
    (:func:`_window_render`): ``A`` is a splice of ``R_k`` (its start then its end: the window renders
    the head and the context as the full render did), ``A`` is a prefix of ``B`` (so a template that
    renders the last message specially, e.g. an assistant turn's reasoning only while it is last,
    falls back here), and ``B`` of ``render(W, True)``. Checked once per template at construction
    (:attr:`incremental`, :attr:`reason`): no position-dependent construct (:func:`_position_hazards`:
    numbering by ``loop.index``, ``loop.length``, ``messages|length`` printed...), nothing read over
    the whole history (:func:`_history_hazards`: a second, reverse or filtered loop over the messages,
    ``namespace`` state set in the message loop, the list used whole), and, on probe chats covering
    system/user/assistant/tool roles, tool calls, reasoning, names, content parts, with and without
    tools, the window result equals the full render for every split. Anything else (a template that
    fails a check, ``continue_final_message``, a request that is not an extension of a cached prefix:
    an edited or removed message, other tools or kwargs) is a full render, so the text is always the
    full render's. Residual limit: the static scan and probes are a proof only for the constructs they
    name; a template computing history-wide facts another way (a macro recursing over the list) relies
    on the probes. A window render that raises falls back to the full render, which decides; a
    template that raises for an early message (role alternation) raised when that prefix was first
    rendered, and later windows do not re-check messages outside them.

    Thread-safe for one caller at a time per entry (the cache's bookkeeping is locked; epp renders a
    long first call in a worker thread).

    Args:
        template: the compiled template.
        max_bytes: bound of the cache (rendered text plus the messages kept to verify it, approximate; LRU).
    """

    def __init__(self, template: ChatTemplate, max_bytes: int = 64 << 20) -> None:
        self.template = template
        self.max_bytes = max_bytes
        specials = tuple(sorted(template.special_tokens.items()))
        self.incremental, self.reason = _probe(template.source, specials)
        self.static_generation = self.incremental and _probe_generation(template.source, specials)
        """Whether the generation prompt is appended text fixed per root (:func:`_static_generation_prompt`,
        confirmed on the probe chats): then a grown chat's window is rendered once, not twice."""
        self._generation: dict[str, str] = {}  # root -> the generation prompt's text (static templates)
        self.last_prefix: Text | None = None
        """The cached prefix text the last :meth:`render` started its result with (None: a full render);
        a hint for the tokenizer's common-prefix search, which verifies it."""
        self._cache: OrderedDict[int, _Rendered] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.stats = {"full": 0, "incremental": 0, "fallback": 0}
        self.rope = True
        """A grown chat's text shares its cached prefix (:class:`TextRope`); off: copied whole into one ``str``
        per call (the benchmark's A/B switch; same text)."""
        self.identity_scan = True
        """:func:`same_as_rendered` checks the cached prefix's messages by identity in C first (off: the
        per-message Python scan; the benchmark's A/B switch; same answer)."""

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a chat body, exactly :func:`render_request`'s.

        Raises:
            MultimodalContent, InvalidRequest: as :func:`render_request`.
        """
        head, tail, _ = self.render_parts(body)
        return flat(head, tail)

    def render_parts(self, body: Mapping[str, Any]) -> tuple[Text, str, Text | None]:
        """:meth:`render`'s text as ``(head, tail, base)``, the text being ``head + tail``: ``head`` is the chat
        without the generation prompt (the object this renderer caches, so a caller keeping it holds no
        copy; a :class:`TextRope` when grown from a cached prefix: the prefix's text is shared, not copied),
        ``tail`` the generation prompt ("" after a full render: then ``head`` is the whole text);
        ``base``: the cached text object ``head`` was built by appending to (``head`` starts with it by
        construction), None after a full render. A grown chat's text is thus never copied whole, nor
        compared whole with the last call's.

        Raises:
            MultimodalContent, InvalidRequest: as :func:`render_request`.
        """
        messages = body.get("messages")
        if not self.incremental or body.get("continue_final_message") or not isinstance(messages, list) or not messages:
            self.stats["full"] += 1
            self.last_prefix = None
            return render_request(self.template, body), "", None
        root = json.dumps([body.get("tools"), body.get("documents"), body.get("chat_template_kwargs")],
                          default=str)  # key order kept: ``tojson`` renders it
        n = len(messages)
        cache = self._cache
        entry: _Rendered | None = None
        for i in range(n - 1, _WINDOW_HEAD + _WINDOW_CONTEXT - 1, -1):
            key = prefix_key(root, messages, i + 1)
            found = cache.get(key)
            if found is not None and found.root == root and len(found.messages) == i + 1 \
                    and same_as_rendered(found.messages, messages, self.identity_scan):
                with self._lock:  # a worker thread may render a long chat meanwhile
                    if key in cache:
                        cache.move_to_end(key)
                entry = found
                break
        agp = bool(body.get("add_generation_prompt", True))
        if entry is None:
            self.stats["full"] += 1
            j, _ = _window_start(messages, n)
            try:
                text = render_request(self.template, {**body, "add_generation_prompt": False})
                done = _window_render(self.template, body, messages[:_WINDOW_HEAD] + messages[j:], text, None, agp)
            except InvalidRequest:  # e.g. a template that refuses a chat without the generation prompt
                done = None
            if done is not None and agp and self.static_generation and root not in self._generation:
                if len(self._generation) >= _GENERATION_ROOTS:
                    self._generation.clear()
                self._generation[root] = done[1]
        else:
            k = len(entry.messages)
            a: str | None = None
            if _WINDOW_CONTEXT <= k - entry.start <= _WINDOW_CONTEXT + _WINDOW_GROWTH:
                j, a = entry.start, entry.window_text  # the entry's own window: render(m[:2] + m[j:k], False)
            else:
                j, _ = _window_start(messages, k)
            window = messages[:_WINDOW_HEAD] + messages[j:]
            try:
                done = _window_render(self.template, body, window, entry.text, len(window) - (n - k), agp, a=a,
                                      generation=self._generation.get(root) if self.static_generation else None)
            except InvalidRequest:  # the window may trip a check the whole chat passes: the full render decides
                done = None
            if done is not None:
                self.stats["incremental"] += 1
        if done is None:
            self.stats["fallback"] += 1
            self.last_prefix = None
            return render_request(self.template, body), "", None
        base = entry.text if entry is not None else None
        self.last_prefix = base
        grown, suffix, window_text = done
        if not self.rope and isinstance(grown, TextRope):
            grown = str(grown)
        self._store(prefix_key(root, messages, n), _Rendered(root, list(messages), grown, j, window_text))
        return grown, suffix, base

    def _store(self, key: int, entry: _Rendered) -> None:
        with self._lock:
            self._store_locked(key, entry)

    def _store_locked(self, key: int, entry: _Rendered) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._bytes -= old.size
        if entry.size > self.max_bytes:
            return
        self._cache[key] = entry
        self._bytes += entry.size
        while self._bytes > self.max_bytes and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._bytes -= dropped.size


@dataclass(slots=True)
class _Rendered:
    """A cached prefix: its root (tools, documents, kwargs), messages, ``render(m[:k], False)``, and its window."""

    root: str
    messages: list[Any]
    text: Text
    start: int  # j: the window was m[:2] + m[j:k]
    window_text: str  # render(m[:2] + m[j:k], False)
    size: int = 0

    def __post_init__(self) -> None:
        self.size = 2 * len(self.text) + len(self.window_text) + len(self.root) + 256 * len(self.messages)


def _window_render(template: ChatTemplate, body: Mapping[str, Any], window: list[Any], prefix: Text,
                   cut: int | None, agp: bool, why: list[str] | None = None,
                   a: str | None = None, generation: str | None = None) -> tuple[Text, str, str] | None:
    """(render(m, False), the generation prompt's text, render(window, False)) from a prefix's text and window
    renders, where ``render(m, agp)`` is the first plus the second (kept apart: the whole chat's text is not
    copied a second time); None: unsafe.

    ``window`` is ``m[:2] + m[j:n]``; ``prefix`` is ``render(m[:k], False)`` with ``cut`` the window's
    message count up to ``k`` (None: ``prefix`` already covers all of ``m``). Checks: the window's text
    up to ``k`` is a splice of ``prefix`` (its start followed by its end: the window renders the head
    and the context messages exactly as the full render does), that text is a prefix of the whole
    window's (no message renders otherwise once another follows it), and the generation prompt only
    appends. ``generation``: the generation prompt's text when the template's is static
    (:attr:`IncrementalRenderer.static_generation`, measured under the same root): appended instead of
    rendering the window a second time.
    """
    plain = {**body, "add_generation_prompt": False}
    b = render_request(template, {**plain, "messages": window})
    given = a is not None
    if a is None:  # (given: the previous request's own window text, the same messages)
        a = b if cut is None else render_request(template, {**plain, "messages": window[:cut]})
    # a given ``a`` is the entry's window text, a splice of the entry's text by construction (checked
    # when the entry was made: its text is the older prefix plus what its window added)
    if not given and not _splice_of(a, prefix):
        if why is not None:
            why.append("context")  # the window renders the head or the context otherwise than the full render
        return None
    if not b.startswith(a):
        if why is not None:
            why.append("prefix")  # a message renders otherwise once another follows it (last-message output)
        return None
    whole = rope_append(prefix, b[len(a):])  # the prefix shared, not copied (a TextRope)
    if not agp:
        return whole, "", b
    if generation is not None:
        return whole, generation, b
    c = render_request(template, {**body, "messages": window})
    if not c.startswith(b):
        return None
    return whole, c[len(b):], b


def _window_start(messages: list[Any], k: int) -> tuple[int, bool]:
    """(j, clean): where the window's messages after the head start, for a prefix of ``k`` messages.

    ``j <= k - 4`` (the context), ``j - 2`` even (``loop.index0`` keeps its parity), and, looking back
    at most 16 messages, ``m[j-1]`` has the role of ``m[1]`` (clean: the window's first context message
    follows a message of the same role as in the full chat, so neighbour reads such as
    ``messages[loop.index0 - 1].role`` agree); ``j == 2`` (the whole chat) is clean too.
    """
    j = max(_WINDOW_HEAD, k - _WINDOW_CONTEXT)
    j -= (j - _WINDOW_HEAD) % 2
    role = _role(messages[_WINDOW_HEAD - 1]) if len(messages) >= _WINDOW_HEAD else None
    for candidate in range(j, max(_WINDOW_HEAD, j - 16) - 1, -2):
        if candidate == _WINDOW_HEAD or _role(messages[candidate - 1]) == role:
            return candidate, True
    return j, False


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, Mapping) else None


def _splice_of(part: str, whole: Text) -> bool:
    """Whether ``part == whole[:p] + whole[len(whole) - (len(part) - p):]`` for some ``p`` (a start and an end of ``whole``)."""
    if len(part) > len(whole):
        return False
    n = len(part)
    text = text_slice(whole, 0, n)
    lo, hi = 0, n  # the longest common prefix of part and text: part[:lo] == text[:lo]
    if part == text:
        return True
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if part[:mid] == text[:mid]:
            lo = mid
        else:
            hi = mid
    return text_slice(whole, len(whole) - (n - lo)) == part[lo:]


def same_as_rendered(cached: Sequence[Any], messages: Sequence[Any], identity_scan: bool = True) -> bool:
    """Whether ``messages`` starts with ``cached``, value for value as a template renders them: the same
    object, or the same ``repr`` (JSON values: ``1``, ``1.0`` and ``True`` are ``==`` in Python and two dicts
    in other key orders too, yet ``tojson`` and ``string`` render them differently). O(len(cached)),
    identity first; a message that is only ``==`` costs its ``repr``."""
    if len(messages) < len(cached):
        return False
    if identity_scan and all(map(is_, cached, messages)):  # the common case (a grown chat's reused messages), in C
        return True
    return all(a is b or (type(a) is type(b) and repr(a) == repr(b)) for a, b in zip(cached, messages, strict=False))


def _message_key(message: Any) -> Any:
    if type(message) is dict:
        content = message.get("content")
        return message.get("role"), content if type(content) is str else len(message)
    if isinstance(message, (tuple, list)) and len(message) == 2:
        return message[0], message[1]
    return None


def prefix_key(root: Any, messages: Sequence[Any], k: int) -> int:
    """A cache key for ``messages[:k]``: the root, ``k``, and the last two messages' roles and texts. O(1).

    Not unique (earlier messages are not read): whoever caches by it verifies the entry itself (the
    messages, or the text), so a collision costs a miss, never a wrong answer.
    """
    return hash((root, k, _message_key(messages[k - 1]), _message_key(messages[k - 2]) if k > 1 else None))


@lru_cache(maxsize=64)
def _probe_generation(source: str, special_tokens: tuple[tuple[str, str], ...]) -> bool:
    """:func:`_static_generation_prompt`, then confirmed on the probe chats: under each root, every
    prefix's ``render(m, True)`` is its ``render(m, False)`` plus one and the same text."""
    template = ChatTemplate(source, dict(special_tokens))
    if not _static_generation_prompt(template._template.environment.parse(source)):
        return False
    for messages, tools in _probe_conversations():
        seen: set[str] = set()
        for n in range(1, len(messages) + 1):
            body = {"messages": messages[:n], "tools": tools}
            try:
                with_prompt = render_request(template, body)
                without = render_request(template, {**body, "add_generation_prompt": False})
            except InvalidRequest:
                continue
            if not with_prompt.startswith(without):
                return False
            seen.add(with_prompt[len(without):])
            if len(seen) > 1:
                return False
    return True


@lru_cache(maxsize=64)
def _probe(source: str, special_tokens: tuple[tuple[str, str], ...]) -> tuple[bool, str]:
    """(window rendering is exact for this template, why not): the static scan, then the probe chats."""
    template = ChatTemplate(source, dict(special_tokens))
    ast = template._template.environment.parse(source)
    hazards = _position_hazards(ast)
    if hazards:
        return False, "position-dependent: " + ", ".join(hazards[:3])
    hazards = _history_hazards(ast)
    if hazards:
        return False, "reads the whole history: " + ", ".join(hazards[:3])
    tried = checked = fell_back = 0
    for messages, tools in _probe_conversations():
        try:
            render_request(template, {"messages": messages, "tools": tools})
        except InvalidRequest:
            continue  # a conversation this template refuses (role order, tools...)
        tried += 1
        for k in range(_WINDOW_HEAD + _WINDOW_CONTEXT, len(messages)):
            for n in sorted({k, k + 1, k + 2, len(messages)}):
                if n > len(messages):
                    continue
                for agp in (True, False):
                    body = {"messages": messages[:n], "tools": tools, "add_generation_prompt": agp}
                    try:
                        expected = render_request(template, body)
                    except InvalidRequest:
                        continue
                    prefix = render_request(template, {"messages": messages[:k], "tools": tools,
                                                       "add_generation_prompt": False})
                    j, clean = _window_start(messages, k)
                    window = messages[:_WINDOW_HEAD] + messages[j:n]
                    why: list[str] = []
                    try:
                        got = _window_render(template, body, window, prefix, len(window) - (n - k), agp, why)
                    except InvalidRequest:
                        got = None
                    if why == ["context"] and clean:
                        return False, (f"the window sees the history otherwise than the full render (state over the "
                                       f"whole history; probe of {len(messages)} messages, k={k}, n={n})")
                    if got is not None and flat(got[0]) + got[1] != expected:
                        return False, f"window render differs from the full render (probe of {len(messages)} messages, k={k}, n={n})"
                    checked += 1
                    fell_back += got is None
    if tried == 0:
        return False, "the template refused every probe conversation"
    if fell_back == checked:
        return False, "not prefix-stable on any probe (every window check fell back)"
    return True, ""
