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
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
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
            except json.JSONDecodeError:
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
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
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


@lru_cache(maxsize=64)
def _compile(source: str) -> tuple[jinja2.Template, frozenset[str], str]:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
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
