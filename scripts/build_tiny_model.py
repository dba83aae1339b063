"""Build the tiny random-weight Llama that real vLLM serves in development and in ``make test-vllm``.

Offline and deterministic: no download, torch seeded with 0, and the tokenizer is the engine
simulator's own (``engine_simulator.tokenizer.ensure_tokenizer``: a byte-level BPE trained on a
corpus generated in code), so a real vLLM and the simulator turn the same text into the same
token ids. Runs inside the vLLM venv (``.venv-vllm``: torch + transformers), with the repository
root on ``PYTHONPATH``::

    PYTHONPATH=. .venv-vllm/bin/python scripts/build_tiny_model.py --out .run/models/tiny-llama

Writes ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32, ~3.4 MB,
852k parameters), ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
(when the transformers version writes it). The model shape is the one behind the shared vLLM 0.32
recordings (``shared/data/vllm-0.32-cpu/model_config.json``): vocab 2048, hidden 128,
intermediate 256, 2 layers, 4 attention / 4 KV heads, head_dim 32 (a CPU-attention size), max
positions 2048, bos 1, eos 2, untied embeddings. The build goes to a temporary directory that is
renamed into place, so an interrupted build never leaves a half model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

MODEL_CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
SEED = 0


def build(out: Path) -> dict[str, object]:
    """Build the model directory at ``out`` (replaced if present). Returns a summary dict.

    Raises:
        ImportError: outside an environment with torch, transformers and tokenizers.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from engine_simulator.tokenizer import BOS, EOS, UNK, ensure_tokenizer, load_chat_template

    t0 = time.perf_counter()
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tok_dir = ensure_tokenizer(tmp / "simulator-tokenizer")
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(tok_dir / "tokenizer.json"),
            bos_token=BOS,
            eos_token=EOS,
            unk_token=UNK,
            model_max_length=2048,
        )
        tokenizer.chat_template = load_chat_template(tok_dir)  # the simulator's template: vLLM renders chats alike
        model_dir = tmp / "model"
        tokenizer.save_pretrained(str(model_dir))
        torch.manual_seed(SEED)
        config = LlamaConfig(**MODEL_CONFIG)
        model = LlamaForCausalLM(config).to(torch.float32)
        model.save_pretrained(str(model_dir), safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
        # The saved tokenizer.json must be the simulator's, byte-identical in what it encodes.
        probe = "def cache(self, key):\n    return self.blocks[key]  # prefix éè"
        sim = json.loads((tok_dir / "tokenizer.json").read_text())
        saved = json.loads((model_dir / "tokenizer.json").read_text())
        if sim["model"]["vocab"] != saved["model"]["vocab"] or sim["model"]["merges"] != saved["model"]["merges"]:
            raise RuntimeError("saved tokenizer differs from the simulator's")
        ids = PreTrainedTokenizerFast.from_pretrained(str(model_dir))(probe)["input_ids"]
        from tokenizers import Tokenizer

        if ids != Tokenizer.from_file(str(tok_dir / "tokenizer.json")).encode(probe).ids:
            raise RuntimeError("saved tokenizer encodes differently from the simulator's")
        if out.exists():
            shutil.rmtree(out)
        os.rename(model_dir, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "out": str(out),
        "parameters": params,
        "files": sorted(p.name for p in out.iterdir()),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".run/models/tiny-llama"), help="model directory")
    args = parser.parse_args(argv)
    summary = build(args.out)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
