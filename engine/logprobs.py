"""Log-probabilities: the columnar form workers send for a run of positions, and the per-token
form users of the engine receive (vLLM's ``dict[token_id, Logprob]`` per position)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec


class LogprobsLists(msgspec.Struct, kw_only=True, array_like=True):
    """Logprobs for consecutive positions (one sampled token, or a prompt chunk's tokens).

    Columnar rather than a Struct per position: a 2048-token prompt chunk is five lists in one
    msgpack frame, not 2048 objects.
    """

    # The token at each position (sampled, or the prompt's), its logprob and its rank (1 = the
    # most likely token).
    token_ids: list[int] = []
    logprobs: list[float] = []
    ranks: list[int] = []
    # The k most likely tokens at each position, most likely first.
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: LogprobsLists) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)
        self.top_token_ids.extend(other.top_token_ids)
        self.top_logprobs.extend(other.top_logprobs)


@dataclass(frozen=True)
class Logprob:
    logprob: float
    # 1 = the most likely token at its position.
    rank: int
    # The token's text on its own (what OpenAI's `tokens` and `top_logprobs` keys show).
    decoded_token: str


# One position: the chosen token first, then the top alternatives not already listed.
PositionLogprobs = dict[int, Logprob]


def to_positions(lists: LogprobsLists, decode: Callable[[int], str]) -> list[PositionLogprobs]:
    """Per-position dicts, as vLLM's ``CompletionOutput.logprobs`` (``decode``: one token id to
    its text)."""
    positions: list[PositionLogprobs] = []
    for i, token_id in enumerate(lists.token_ids):
        entry = {token_id: Logprob(lists.logprobs[i], lists.ranks[i], decode(token_id))}
        for rank, (top_id, top_lp) in enumerate(zip(lists.top_token_ids[i],
                                                    lists.top_logprobs[i]), start=1):
            if top_id not in entry:
                entry[top_id] = Logprob(top_lp, rank, decode(top_id))
        positions.append(entry)
    return positions
