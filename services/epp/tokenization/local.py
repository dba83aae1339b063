"""A model's own tokenizer and chat template, in-process, with an incremental per-prefix cache. Pure after load.

Files (a HF model directory, as vLLM loads it): ``tokenizer.json`` (HF ``tokenizers``),
``tokenizer_config.json`` (special tokens: ``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``;
an inline ``chat_template``), and ``chat_template.jinja`` (preferred over the inline one, as in
transformers). Rendering is ``kvmesh.chat_template`` (vLLM 0.32's rules); encoding is the tokenizer's
``encode`` with ``add_special_tokens`` as the request says (chat default False, completions True).

**Incremental chats.** Added tokens (``<s>``, ``</s>``, ``<|im_start|>``...) are matched in the text
*before* normalisation and pre-tokenisation, and the pieces between them are encoded independently
(HF ``tokenizers``' ``AddedVocabulary``). So where an added token without ``lstrip``/``rstrip``/
``single_word`` starts at character ``c`` of a cached text ``S`` and a new text ``T`` agrees with ``S``
up to ``c`` plus the longest added token, ``encode(T) = ids(S)[:k] + encode(T[c:])`` exactly (``k``:
that token's index). A chat whose history grew by a turn therefore encodes only from the last
template special token before the change: the new turn. Entries are found by per-prefix keys of the
request (model, template, tools..., the prefix's length and last messages), verified by comparing the texts
themselves, so a hash collision can only cost a miss, never a wrong token. The cache is bounded by
total tokens held (LRU). Where every added token is plain (no strip, single-word or normalized
matching) the text is encoded without offsets (``encode_batch_fast``, ~25 % cheaper) and the cuts are
found in the text itself, checked against the encoding's added-token ids (the offsets decide otherwise).

The text itself is rendered incrementally too (:class:`kvmesh.chat_template.IncrementalRenderer`: the
cached prefix's rendered text plus a short window render of the new messages, for templates probed
at load to be exact that way; the full render otherwise), so a grown chat costs neither a full
render nor a full encode. A request's ``chat_template`` override is always rendered in full.

Nothing history-sized is copied per call either: an entry keeps its text as ``(head, tail)``, ``head``
being the renderer's own cached object (a :class:`kvmesh.chat_template.TextRope` sharing the cached
prefix's text: the grown text is never joined) and ``tail`` the generation prompt (the common prefix
with the next call is read near the end only), and its ids as :class:`kvmesh.hashing.GrowingTokenIds` (the cached bytes
shared, the new turn appended to a tail, block keys memoised per key space and carried to the grown
entry, so the prefix index hashes only the new blocks without comparing bytes).

**The new turn's encoding.** Where the tokenizer is a GPT-2-style byte-level BPE and its added tokens
are plain, an ASCII text up to :data:`ASCII_MAX_CHARS` (a new turn) is split at the added tokens here
and each chunk encoded by :class:`~services.epp.tokenization.ascii_bytelevel.AsciiByteLevel` (the same
ids as HF's encoder, ~4-6x faster: HF spends a turn's encode mostly in its pre-tokenizer and
``Encoding`` bookkeeping); other texts and tokenizers use HF ``tokenizers``.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from tokenizers import Tokenizer

from kvmesh.chat_template import ChatTemplate, IncrementalRenderer, Text, flat, prefix_key, render_request, text_slice
from kvmesh.errors import InvalidRequest
from kvmesh.hashing import GrowingTokenIds
from services.epp.tokenization.ascii_bytelevel import AsciiByteLevel

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateUnavailable(InvalidRequest):
    """The model has no chat template (vLLM answers such a chat with 400)."""


@dataclass(slots=True)
class _Entry:
    head: Text  # the text is head + tail: head is the renderer's cached chat text (shared, not a copy)
    tail: str  # the generation prompt ("" when head is the whole text)
    ids: Sequence[int]  # a GrowingTokenIds on little-endian hosts (the ids as uint32 bytes, keys memoised), else a list
    cuts: list[tuple[int, int]]  # (char offset, token index) of safe added tokens, ascending


ASCII_MAX_CHARS = 16_384
"""Longest text :class:`AsciiByteLevel` encodes (Python, holding the GIL); longer ones (a chat's first call,
encoded in a worker thread) go to HF ``tokenizers``."""

_PACK = sys.byteorder == "little" and array("I").itemsize == 4
"""Whether ``array('I')`` bytes are the little-endian uint32 form kvmesh's block keys hash."""


def _packed(ids: list[int]) -> Sequence[int]:
    """``ids`` as :class:`~kvmesh.hashing.GrowingTokenIds` (their uint32 bytes) where the host packs so."""
    if not _PACK:  # pragma: no cover - big-endian host: plain ids (the replica converts them)
        return ids
    return GrowingTokenIds.build(ids)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _common_prefix(a: str, b: str, hint: str | None = None) -> int:
    """Length of the longest common prefix (C-speed slice compares, then a short scan).

    ``hint``: a text both may start with (checked with ``startswith``, a ``memcmp`` without copies):
    when both do, only what follows it is compared.
    """
    if hint and a.startswith(hint) and b.startswith(hint):
        h = len(hint)
        return h + _common_prefix(a[h:], b[h:])
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _common_prefix_parts(a1: Text, a2: str, b1: Text, b2: str, b1_extends_a1: bool = False) -> int:
    """:func:`_common_prefix` of ``a1 + a2`` and ``b1 + b2`` without building either: one ``startswith``
    (a ``memcmp``) over the shorter head, then the short rest. ``b1_extends_a1``: ``b1`` is known to
    start with ``a1`` (built by appending to it), so the heads are not compared (and a
    :class:`~kvmesh.chat_template.TextRope` head is read only near its end)."""
    if not (b1_extends_a1 and len(b1) >= len(a1)):
        a1, b1 = flat(a1), flat(b1)  # an edited or other chat (rare): compared whole
        if len(a1) > len(b1):
            a1, a2, b1, b2 = b1, b2, a1, a2
        if not b1.startswith(a1):
            return _common_prefix(a1, b1)  # they differ within a1 (an edited history)
    h, n = len(a1), len(a2)
    rest = text_slice(b1, h, h + n)
    if len(rest) < n:
        rest += b2[: n - len(rest)]
    return h + _common_prefix(a2, rest)


def _positions(ids: list[int], wanted: Iterable[int]) -> Iterator[int]:
    """Every index of ``ids`` holding one of ``wanted`` (``list.index`` scans in C, one call per occurrence)."""
    for token in wanted:
        i = -1
        try:
            while True:
                i = ids.index(token, i + 1)
                yield i
        except ValueError:
            continue


class LocalTokenizer:
    """One model's tokenizer + chat template.

    Args:
        path: the model (or tokenizer) directory.
        cache_max_tokens: token ids kept in the incremental chat cache (LRU by entry).
        render_cache_bytes: bound of the incremental rendering cache
            (:class:`kvmesh.chat_template.IncrementalRenderer`; LRU by bytes).

    Raises:
        OSError: ``tokenizer.json`` missing or unreadable.
        InvalidRequest: the chat template does not parse.
    """

    def __init__(self, path: str | Path, cache_max_tokens: int = 2_000_000, render_cache_bytes: int = 64 << 20) -> None:
        directory = Path(path)
        if directory.name == "tokenizer.json":
            directory = directory.parent
        self.path = directory
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        config: dict[str, Any] = {}
        config_file = directory / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
        source: str | None = None
        if (directory / "chat_template.jinja").is_file():
            source = (directory / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in config["chat_template"] if isinstance(t, dict)}
            source = named.get("default")
        self.template = ChatTemplate(source, self.special_tokens) if source else None
        self.renderer = IncrementalRenderer(self.template, render_cache_bytes) if self.template else None
        added = self.tokenizer.get_added_tokens_decoder()
        self._cut_ids = frozenset(i for i, t in added.items() if not (t.lstrip or t.rstrip or t.single_word)
                                  and not t.normalized)
        self._margin = max((len(t.content) for t in added.values()), default=0) + 1
        self._added_content = {i: t.content for i, t in added.items()}
        self._added_ids = frozenset(added)
        plain = bool(added) and not getattr(self.tokenizer, "encode_special_tokens", False) and all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self._added_re = re.compile("|".join(re.escape(c) for c in sorted(
            {t.content for t in added.values()}, key=len, reverse=True))) if plain else None
        """Every added token's text, longest first (leftmost-longest, as HF's added-vocabulary matcher on
        the raw text); None when some added token is matched otherwise (stripped, single-word,
        normalized): then the cuts come from the encoding's offsets."""
        self._added_by_content = {t.content: i for i, t in added.items()}
        self._ascii: AsciiByteLevel | None = None
        """The exact ASCII encoder (:mod:`~services.epp.tokenization.ascii_bytelevel`) where the tokenizer is a
        GPT-2-style byte-level BPE and every added token is plain (found by :attr:`_added_re`); else None."""
        if self._added_re is not None and len(self._added_by_content) == len(added):
            try:
                data = json.loads((directory / "tokenizer.json").read_text())
            except (OSError, ValueError):
                data = {}
            self._ascii = AsciiByteLevel.for_tokenizer(self.tokenizer, data) if isinstance(data, dict) else None
        probe = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(probe) + 1) if full[i:i + len(probe)] == probe), 0)
        self._prefix_ids, self._suffix_ids = full[:at], full[at + len(probe):]
        self._cache: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._cached_tokens = 0
        self._max_tokens = cache_max_tokens
        self.stats = {"hit": 0, "incremental": 0, "full": 0, "encoded_chars": 0}
        self.share_growth = True
        """A grown chat shares its cached text (the renderer's object) and ids (the cached bytes and block
        keys, :class:`~kvmesh.hashing.GrowingTokenIds`); off: both are copied whole per call and the keys
        found by comparing bytes (the benchmark's A/B switch; same tokens)."""

    # -- encoding ---------------------------------------------------------------------------------

    def special_count(self) -> int:
        """Tokens ``add_special_tokens=True`` adds (e.g. 1 for a BOS-only template)."""
        return len(self._prefix_ids) + len(self._suffix_ids)

    def _raw(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """``encode(text, add_special_tokens=False)`` ids and the ``(char offset, token index)`` of its safe cuts.

        Fast path (plain added tokens): the offset-free encoder (``encode_batch_fast``, ~25 % cheaper),
        then the added tokens located in the text by :attr:`_added_re`; used only when the located
        tokens are exactly the added-token ids of the encoding, in order (else the offsets decide).
        """
        self.stats["encoded_chars"] += len(text)
        if self._ascii is not None and self._added_re is not None and len(text) <= ASCII_MAX_CHARS and text.isascii():
            return self._raw_ascii(text, self._ascii, self._added_re)
        if self._added_re is not None:
            ids = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
            present = self._added_ids.intersection(ids)
            if not present:
                return ids, []
            at = sorted(_positions(ids, present))
            found = [(m.start(), m.group()) for m in self._added_re.finditer(text)]
            content = self._added_content
            if len(found) == len(at) and all(content[ids[i]] == c for i, (_, c) in zip(at, found, strict=True)):
                cut_ids = self._cut_ids
                return ids, [(o, i) for i, (o, _) in zip(at, found, strict=True) if ids[i] in cut_ids]
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = enc.ids
        present = self._cut_ids.intersection(ids)  # in C; special tokens are few per turn
        if not present:
            return ids, []
        at = sorted(_positions(ids, present))
        offsets = enc.offsets
        return ids, [(offsets[i][0], i) for i in at]

    def _raw_ascii(self, text: str, encoder: AsciiByteLevel,
                   added: re.Pattern[str]) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`_raw` of an ASCII text: split at the added tokens (``added``: leftmost-longest, as HF's added
        vocabulary matches them on the raw text), each chunk between them through :class:`AsciiByteLevel`
        (the same ids as HF's encoder); the cuts are where the split found them."""
        ids: list[int] = []
        cuts: list[tuple[int, int]] = []
        pos = 0
        by_content, cut_ids = self._added_by_content, self._cut_ids
        for match in added.finditer(text):
            start = match.start()
            if start > pos:
                ids += encoder.encode(text[pos:start])
            token = by_content[match.group()]
            if token in cut_ids:
                cuts.append((start, len(ids)))
            ids.append(token)
            pos = match.end()
        if pos < len(text):
            ids += encoder.encode(text[pos:] if pos else text)
        return ids, cuts

    def with_specials(self, ids: Sequence[int], add_special_tokens: bool) -> Sequence[int]:
        """``ids`` with the post-processor's special tokens around them when asked (as ``encode`` adds them)."""
        if not add_special_tokens or not (self._prefix_ids or self._suffix_ids):
            return ids
        return [*self._prefix_ids, *ids, *self._suffix_ids]

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens)`` ids (no cache)."""
        return list(self.with_specials(self._raw(text)[0], add_special_tokens))

    def chat_text(self, body: Mapping[str, Any]) -> str:
        """The rendered prompt of a chat body (``messages`` and the rendering fields).

        Raises:
            TemplateUnavailable: the model has no template and the body gives none.
            kvmesh.chat_template.MultimodalContent, InvalidRequest: see ``kvmesh.chat_template``.
        """
        template = self.template
        override = body.get("chat_template")
        if override is not None:
            if not isinstance(override, str):
                raise InvalidRequest("chat_template must be a string")
            template = ChatTemplate(override, self.special_tokens)
        if template is None:
            raise TemplateUnavailable(f"no chat template for the tokenizer in {self.path}")
        if template is self.template and self.renderer is not None:
            return self.renderer.render(body)
        return render_request(template, body)

    def _chat_parts(self, body: Mapping[str, Any]) -> tuple[Text, str, Text | None]:
        """:meth:`chat_text` as ``(head, tail, base)`` (the text is ``head + tail``; ``head`` starts with
        ``base`` when not None: :meth:`kvmesh.chat_template.IncrementalRenderer.render_parts`). Raises as
        :meth:`chat_text`."""
        if body.get("chat_template") is None and self.renderer is not None:
            if not self.share_growth:
                return self.renderer.render(body), "", None
            return self.renderer.render_parts(body)
        return self.chat_text(body), "", None

    def chat_ids(self, body: Mapping[str, Any], chain: Sequence[int] | None = None) -> Sequence[int]:
        """Token ids of a chat body (before ``truncate_prompt_tokens``), incrementally when possible.

        Args:
            body: ``messages`` plus the fields of ``services.epp.tokenization.fields.CHAT_FIELDS``.
            chain: per-message cache keys (:func:`message_chain`); None disables the cache.
        """
        head, tail, grown_from = self._chat_parts(body)
        add = body.get("add_special_tokens") is True
        if not chain:
            return self.with_specials(self._raw(flat(head, tail))[0], add)
        key = chain[-1]
        entry = self._cache.get(key)
        if entry is not None and entry.head == head and entry.tail == tail:
            with self._lock:  # chat_ids may run in a worker thread (a long first call) meanwhile
                if key in self._cache:
                    self._cache.move_to_end(key)
            self.stats["hit"] += 1
            return self.with_specials(entry.ids, add)
        base = None
        for k in reversed(chain):
            found = self._cache.get(k)
            if found is not None and found.cuts:
                base = found
                break
        new = self._extend(base, head, tail, base.head is grown_from) if base is not None else None
        if new is None:
            self.stats["full"] += 1
            ids, cuts = self._raw(flat(head, tail))
            new = _Entry(head, tail, _packed(ids), cuts)
        else:
            self.stats["incremental"] += 1
        self._store(key, new)
        return self.with_specials(new.ids, add)

    def has_cached_prefix(self, chain: Sequence[int]) -> bool:
        """Whether some prefix of ``chain`` has a cache entry (the next :meth:`chat_ids` is then cheap)."""
        cache = self._cache
        return any(k in cache for k in reversed(chain))

    def _extend(self, base: _Entry, head: Text, tail: str, extends: bool = False) -> _Entry | None:
        """``base`` grown to the text ``head + tail``; None when no cut allows it. ``extends``: ``head`` is known
        to start with ``base.head`` (the renderer appended to that very object), so it is not compared."""
        same = _common_prefix_parts(base.head, base.tail, head, tail, extends)
        limit = same - self._margin
        cuts = base.cuts
        lo, hi = 0, len(cuts)  # the last cut with offset <= limit
        while lo < hi:
            mid = (lo + hi) // 2
            if cuts[mid][0] <= limit:
                lo = mid + 1
            else:
                hi = mid
        if lo == 0:
            return None
        offset, index = cuts[lo - 1]
        h = len(head)
        ids, tail_cuts = self._raw(text_slice(head, offset) + tail if offset <= h else tail[offset - h:])  # the new turn only
        old = base.ids
        if isinstance(old, GrowingTokenIds) and self.share_growth:  # only the new turn's ids are packed
            grown: Sequence[int] = old.spliced(index, ids)
        elif isinstance(old, GrowingTokenIds):
            grown = GrowingTokenIds(b"".join((memoryview(old.tobytes())[: 4 * index], array("I", ids))),
                                    index + len(ids))
        else:
            grown = _packed(list(old[:index]) + ids)
        return _Entry(head, tail, grown, cuts[: lo - 1] + [(o + offset, i + index) for o, i in tail_cuts])

    def _store(self, key: int, entry: _Entry) -> None:
        with self._lock:
            self._store_locked(key, entry)

    def _store_locked(self, key: int, entry: _Entry) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cached_tokens -= len(old.ids)
        if len(entry.ids) > self._max_tokens:
            return
        self._cache[key] = entry
        self._cached_tokens += len(entry.ids)
        while self._cached_tokens > self._max_tokens and self._cache:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= len(dropped.ids)


class PrefixKeys(Sequence[int]):
    """Cache keys of each message prefix, computed when read (:func:`kvmesh.chat_template.prefix_key`). O(1) each.

    ``keys[i]`` keys ``messages[:i + 1]`` under ``root``. Not unique: texts are compared before any
    cached ids are reused, so a collision costs a miss.
    """

    def __init__(self, root: Any, messages: Sequence[Any]) -> None:
        self._root = root
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self._messages)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return prefix_key(self._root, self._messages, i + 1)

    def __reversed__(self) -> Iterator[int]:
        for i in range(len(self._messages), 0, -1):
            yield prefix_key(self._root, self._messages, i)


def message_chain(root: Any, messages: Sequence[Any]) -> PrefixKeys:
    """The cache keys of each prefix of ``messages`` (:class:`PrefixKeys`), ``root`` naming the model, template and fields."""
    return PrefixKeys(root, messages)
