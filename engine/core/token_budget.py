"""Shapes of the steps the engine runs on its own at startup (the KV-pool profile, kernel
warm-ups): a token budget spread over sequences that each fit in max_model_len.

A sequence longer than max_model_len reads positions past the model's rotary table: on a GPU
that is a device-side assert that loses the CUDA context at startup, on a CPU an
IndexError. As vLLM's profile run does, a budget larger than one sequence may hold is spread
over more sequences instead of being cut.
"""

from __future__ import annotations


def split_token_budget(num_tokens: int, max_len: int, min_seqs: int = 1) -> list[int]:
    """Sequence lengths that add up to `num_tokens`, each at most `max_len`: over `min_seqs`
    sequences, or as few more as keep each within `max_len` (never more sequences than
    tokens), as even as can be (lengths differ by one at most, the longer first).

    >>> split_token_budget(2048, 256)
    [256, 256, 256, 256, 256, 256, 256, 256]
    >>> split_token_budget(10, 4)
    [4, 3, 3]
    >>> split_token_budget(10, 64, min_seqs=4)
    [3, 3, 2, 2]
    """
    for name, value in (("num_tokens", num_tokens), ("max_len", max_len),
                        ("min_seqs", min_seqs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"split_token_budget: {name} must be an integer >= 1, "
                             f"got {value!r}")
    num_seqs = min(num_tokens, max(min_seqs, -(-num_tokens // max_len)))
    base, extra = divmod(num_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def largest_step_tokens(max_num_batched_tokens: int, max_num_seqs: int, max_len: int) -> int:
    """The most tokens one step of the scheduler can hold: its budget, unless max_num_seqs
    sequences of max_len tokens hold fewer."""
    return min(max_num_batched_tokens, max_num_seqs * max_len)
