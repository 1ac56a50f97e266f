"""Prefix salts: the first few tokens of every prompt an HTTP replay sends, replaced by tokens
drawn afresh for each request of each replay, so that no replay finds its prompts in a server's
prefix cache.

A server keeps its prefix cache from one replay to the next: without salts, a second replay of
a trace (another budget or seed, the warm-up's copy of the first request, an earlier benchmark
run against the same server, the same trace against a peer sharing a cache) would find its
prompts cached and look faster than the first. A salt changes a prompt's first block, and with
it the hash of every later block (vLLM chains them) and every path of a radix tree (SGLang).
The salt replaces the prompt's first tokens rather than adding to them: every prompt keeps its
trace length (and so fits the context the trace was cut for), and every run does the same work
as every other and as the in-process runner.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterable, Sequence

# Four tokens drawn from the thousands of distinct tokens of a trace: two salts agree with a
# chance of about one in 10^13.
PREFIX_SALT_TOKENS = 4


def salted(prompt: Sequence[int], salt: Sequence[int]) -> list[int]:
    """`prompt` with its first tokens replaced by `salt` (all of it, when shorter): the same
    length."""
    n = min(len(salt), len(prompt))
    return [*salt[:n], *prompt[n:]]


class PrefixSalts:
    """Salts for one replay: `num_tokens` token ids each, drawn from the tokens of the replay's
    own prompts (ordinary text tokens of the model's vocabulary) by a generator seeded from the
    OS, so that no two replays, in this process or another, share one; within this process a
    salt is never handed out twice."""

    _issued: set[tuple[int, ...]] = set()  # every salt this process has handed out

    def __init__(self, prompts: Iterable[Sequence[int]], num_tokens: int = PREFIX_SALT_TOKENS,
                 seed: int | None = None) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self.num_tokens = num_tokens
        self.pool = sorted({t for p in prompts for t in p})
        if num_tokens and not self.pool:
            raise ValueError("no prompt tokens to draw salts from")
        self._rng = random.Random(secrets.randbits(64) if seed is None else seed)

    def draw(self) -> list[int]:
        if self.num_tokens == 0:
            return []
        for _ in range(1000):
            salt = tuple(self._rng.choice(self.pool) for _ in range(self.num_tokens))
            if salt not in PrefixSalts._issued:
                PrefixSalts._issued.add(salt)
                return list(salt)
        raise ValueError(f"no unused prefix salt of {self.num_tokens} tokens left among "
                         f"{len(self.pool)} distinct tokens")
