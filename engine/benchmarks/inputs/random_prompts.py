"""Seeded random prompts (token ids) of a fixed length: what the throughput benchmarks feed the
engine and HF transformers alike, so both sides see the same tokens."""

from __future__ import annotations

import torch


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids drawn from [100, vocab) with a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    # Avoid the lowest ids (special tokens) so no prompt contains an EOS.
    return torch.randint(100, vocab, (count, length), generator=g).tolist()
