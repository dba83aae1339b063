"""The tokenizer is built offline, deterministically, with the recording's shape."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from engine_simulator.tokenizer import TOKENIZER_CONFIG, ensure_tokenizer
from tests.support import recording


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()


def test_parallel_builds_are_byte_identical(tmp_path: Path) -> None:
    """Separate processes (as on two machines) racing on one directory and on others agree byte for byte."""
    code = (
        "import sys; from engine_simulator.tokenizer import ensure_tokenizer; ensure_tokenizer(sys.argv[1])"
    )
    targets = [tmp_path / "shared", tmp_path / "shared", tmp_path / "other"]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(t)]) for t in targets]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    assert _digest(tmp_path / "shared") == _digest(tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "shared"]  # no temp dirs left


def test_shape_matches_the_recorded_tokenizer(tmp_path: Path) -> None:
    directory = ensure_tokenizer(tmp_path / "tok")
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.get_vocab_size() == 2048
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    ids = tok.encode("def f(x):\n    return x  # é").ids
    assert ids[0] == 1 and 0 not in ids  # BOS first; byte-level: nothing is unknown
    assert tok.decode(ids) == "def f(x):\n    return x  # é"
    assert tok.encode("hello", add_special_tokens=False).ids[0] != 1
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config == TOKENIZER_CONFIG
    assert config == json.loads(recording("tokenizer_config.json").read_text())


def test_existing_tokenizer_is_reused(tmp_path: Path) -> None:
    directory = ensure_tokenizer(tmp_path / "tok")
    stamp = (directory / "tokenizer.json").stat().st_mtime_ns
    assert ensure_tokenizer(directory / "tokenizer.json") == directory
    assert (directory / "tokenizer.json").stat().st_mtime_ns == stamp
