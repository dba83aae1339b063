"""Fixtures shared by epp's tokenization tests: the simulator's tokenizer files and its renderer (the engine's tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_simulator.rendering import Renderer
from engine_simulator.tokenizer import ensure_tokenizer, load_chat_template, load_tokenizer


@pytest.fixture(scope="module")
def tok_dir() -> Path:
    return ensure_tokenizer()


@pytest.fixture(scope="module")
def engine(tok_dir: Path) -> Renderer:
    return Renderer(load_tokenizer(str(tok_dir)), load_chat_template(tok_dir))
