"""A small byte-level BPE tokenizer trained in the test, so tiny models can take text prompts."""

from __future__ import annotations

from pathlib import Path

from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer


def save_tiny_tokenizer(path: str | Path, vocab_size: int = 400) -> Path:
    return save_small_tokenizer(path, vocab_size)
