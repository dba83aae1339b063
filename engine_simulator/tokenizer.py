"""The simulator's tokenizer: a small byte-level BPE built offline, deterministically.

It has the shape of the tokenizer behind the vLLM 0.32 recordings (``shared/data/vllm-0.32-cpu``):
a ``tokenizers`` BPE model, vocabulary 2048, special tokens ``<unk>``, ``<s>``, ``</s>`` (ids 0, 1, 2),
a ByteLevel pre-tokenizer without prefix space and the ByteLevel decoder, the full 256-byte initial
alphabet (every text encodes, nothing maps to ``<unk>``), and a template post-processor that
prepends ``<s>``. It is trained on a corpus generated in code from a fixed seed (synthetic English
sentences and Python-like code), so every machine builds the byte-identical ``tokenizer.json``
without any download.

:func:`ensure_tokenizer` builds ``tokenizer.json``, ``tokenizer_config.json`` and the chat template
(``chat_template.jinja``, :data:`CHAT_TEMPLATE`) once, under
``~/.cache/kvmesh/tokenizer-v1/`` by default, and returns the directory. Builds go to a temporary
directory beside the target, then move into place with an atomic ``rename``, so parallel processes
never see a half-written file (the loser of a race drops its copy).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

logger = logging.getLogger(__name__)

VOCAB_SIZE = 2048
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
TOKENIZER_VERSION = "tokenizer-v1"
DEFAULT_DIR = Path.home() / ".cache" / "kvmesh" / TOKENIZER_VERSION
CORPUS_SEED = 20240601

TOKENIZER_CONFIG = {
    "backend": "tokenizers",
    "bos_token": BOS,
    "eos_token": EOS,
    "model_max_length": 2048,
    "tokenizer_class": "TokenizersBackend",
    "unk_token": UNK,
}
"""Same keys and values as the recording's ``tokenizer_config.json``."""

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{ '<|tools|>\\n' + (tools | tojson) + eos_token + '\\n' }}{% endif %}"
    "{%- if documents %}{% for doc in documents %}"
    "{{ '<|document|>\\n' + (doc | tojson) + eos_token + '\\n' }}{% endfor %}{% endif %}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>\\n' }}"
    "{%- if message.get('tool_call_id') %}{{ '[' + message['tool_call_id'] + '] ' }}{% endif %}"
    "{%- if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "{{ '<|tool_call|>' + ({'id': call.get('id', ''), 'name': call['function']['name'],"
    " 'arguments': call['function']['arguments']} | tojson) }}{% endfor %}{% endif %}"
    "{{- eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think></think>\\n' }}{% endif %}"
    "{%- endif %}"
)
"""The tiny model's chat template (``chat_template.jinja`` beside ``tokenizer.json``, which transformers
and vLLM load): ``<s>``, then ``<|tools|>\\n{tools as JSON}</s>\\n`` when tools are given (likewise each
document), then per message ``<|{role}|>\\n`` + ``[{tool_call_id}] `` (tool results) + its string
content + one ``<|tool_call|>{"id","name","arguments"}`` per tool call + ``</s>\\n``, then
``<|assistant|>\\n`` when ``add_generation_prompt`` (and ``<think></think>\\n`` after it when the
``enable_thinking`` kwarg is false). For plain ``{role, content}`` chats this is the fixed format the
simulator always used."""

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "what",
    "more",
    "no",
    "can",
    "will",
    "about",
    "model",
    "token",
    "cache",
    "block",
    "request",
    "server",
    "engine",
    "prefix",
    "batch",
    "queue",
    "latency",
    "memory",
    "router",
    "index",
    "event",
    "prompt",
    "output",
    "input",
    "sequence",
    "decode",
    "prefill",
    "schedule",
    "worker",
    "endpoint",
    "policy",
    "score",
    "metric",
    "time",
    "value",
    "system",
    "user",
    "assistant",
    "question",
    "answer",
    "function",
    "return",
    "class",
    "import",
    "data",
    "file",
    "path",
    "string",
    "number",
    "list",
    "time",
    "people",
    "year",
    "way",
    "day",
    "thing",
    "man",
    "world",
    "life",
    "hand",
    "part",
    "child",
    "eye",
    "woman",
    "place",
    "work",
    "week",
    "case",
    "point",
    "government",
    "company",
    "group",
    "problem",
    "fact",
    "good",
    "new",
    "first",
    "last",
    "long",
    "great",
    "little",
    "own",
    "other",
    "old",
    "right",
    "big",
    "high",
    "different",
    "small",
    "large",
    "next",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "make",
    "know",
    "take",
    "see",
    "come",
    "think",
    "look",
    "want",
    "give",
    "use",
    "find",
    "tell",
    "ask",
    "seem",
    "feel",
    "try",
    "leave",
    "call",
    "keep",
    "let",
    "begin",
    "help",
    "show",
    "hear",
    "play",
    "run",
    "move",
    "live",
    "believe",
    "hold",
    "bring",
    "happen",
    "write",
    "provide",
    "sit",
    "stand",
    "lose",
    "pay",
    "meet",
    "include",
    "continue",
]
_IDENTS = [
    "self",
    "request",
    "tokens",
    "block_size",
    "cache",
    "key",
    "value",
    "result",
    "items",
    "count",
    "index",
    "node",
    "parent",
    "child",
    "config",
    "logger",
    "event",
    "batch",
    "queue",
    "state",
    "endpoint",
    "score",
    "policy",
    "path",
    "data",
    "name",
    "size",
    "offset",
    "buffer",
    "stream",
]
_KEYWORDS = (
    "def",
    "return",
    "if",
    "else",
    "for",
    "while",
    "in",
    "not",
    "and",
    "or",
    "import",
    "from",
    "class",
)


_SYLLABLES = (
    "ka",
    "lo",
    "mi",
    "ten",
    "ro",
    "sha",
    "vu",
    "quel",
    "dra",
    "pin",
    "tor",
    "ex",
    "zy",
    "bar",
    "nic",
)


def _word(rng: random.Random) -> str:
    if rng.random() < 0.85:
        return rng.choice(_WORDS)
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 16))]
    words[0] = words[0].capitalize()
    text = " ".join(words)
    if rng.random() < 0.3:
        text += f", {rng.choice(_WORDS)} {rng.randint(0, 999)}"
    return text + rng.choice((".", ".", ".", "?", "!"))


def _code(rng: random.Random) -> str:
    name = "_".join(rng.choice(_IDENTS) for _ in range(rng.randint(1, 2)))
    args = ", ".join(rng.sample(_IDENTS, rng.randint(1, 3)))
    lines = [f"def {name}({args}):", f'    """{_sentence(rng)}"""']
    for _ in range(rng.randint(2, 6)):
        a, b = rng.choice(_IDENTS), rng.choice(_IDENTS)
        kind = rng.random()
        if kind < 0.3:
            lines.append(f"    {a} = {b}[{rng.randint(0, 64)}] + {rng.randint(1, 9)}")
        elif kind < 0.55:
            lines.append(f"    if {a} {rng.choice(('==', '!=', '<', '>='))} {b}:")
            lines.append(f"        {a}.{rng.choice(_IDENTS)}({b})")
        elif kind < 0.8:
            lines.append(f"    for {a} in {b}:")
            lines.append(f"        {rng.choice(_KEYWORDS[:1]) and 'yield'} {a}")
        else:
            lines.append(f"    # {_sentence(rng).lower()}")
    lines.append(f"    return {rng.choice(_IDENTS)}")
    return "\n".join(lines) + "\n"


def synthetic_corpus(seed: int = CORPUS_SEED, documents: int = 1500) -> list[str]:
    """The training corpus: ``documents`` strings of English prose or code, fixed by ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(documents):
        if rng.random() < 0.6:
            out.append(" ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n")
        else:
            out.append(_code(rng))
    return out


def build_tokenizer() -> Tokenizer:
    """Train the tokenizer in memory (about a second). Deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tok


def ensure_tokenizer(path: str | os.PathLike[str] | None = None) -> Path:
    """Make sure ``<dir>/tokenizer.json`` and ``<dir>/tokenizer_config.json`` exist; return ``<dir>``.

    Args:
        path: the directory (or a ``tokenizer.json`` file path, whose directory is used);
            None means ``~/.cache/kvmesh/tokenizer-v1/``.

    Returns:
        The directory holding both files.

    Raises:
        OSError: when the directory cannot be created or written.
    """
    target = Path(path) if path is not None else DEFAULT_DIR
    if target.name == "tokenizer.json":
        target = target.parent
    if (target / "tokenizer.json").is_file():
        if not (target / CHAT_TEMPLATE_FILE).is_file():  # a directory from before the template existed
            _write_atomic(target / CHAT_TEMPLATE_FILE, CHAT_TEMPLATE)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)
        build_tokenizer().save(str(tmp / "tokenizer.json"), pretty=False)
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(TOKENIZER_CONFIG, indent=2, sort_keys=True) + "\n"
        )
        (tmp / CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
        if target.exists():
            # an empty or partial directory given by the caller: fill it file by file (atomic per file)
            for name in (CHAT_TEMPLATE_FILE, "tokenizer_config.json", "tokenizer.json"):
                os.replace(tmp / name, target / name)
        else:
            try:
                os.rename(tmp, target)
                logger.info("built tokenizer dir=%s", target)
            except OSError:
                if not (target / "tokenizer.json").is_file():  # lost a race to something odd
                    raise
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
    return target


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load_chat_template(path: str | os.PathLike[str] | None = None) -> str:
    """The chat template text of :func:`ensure_tokenizer`'s directory."""
    return (ensure_tokenizer(path) / CHAT_TEMPLATE_FILE).read_text()


@lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None) -> Tokenizer:
    """``Tokenizer.from_file`` on :func:`ensure_tokenizer`'s output (cached per path)."""
    directory = ensure_tokenizer(path)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))
