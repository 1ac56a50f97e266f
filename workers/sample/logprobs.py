"""Log-probabilities from logits rows: the sampled token's (with its rank and the top k) and a
prompt's (each row scored against the token that follows it).

``logprob_tensors`` stays on the device, so that the sampler can read its results back in the
same transfer as the tokens (workers.host_transfer); ``logprobs_of`` reads them on its own, in one
transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.logprobs import LogprobsLists
from workers.host_transfer import read_back


@dataclass(frozen=True)
class LogprobTensors:
    """One row per position, on the logits' device."""

    chosen: torch.Tensor      # float32 [N]: the log-softmax at the position's token
    ranks: torch.Tensor       # long [N]: 1 = most likely; ties share the better rank
    top_ids: torch.Tensor     # long [N, k]: the k most likely tokens, most likely first
    top_values: torch.Tensor  # float32 [N, k]: their logprobs

    def as_list(self) -> list[torch.Tensor]:
        return [self.chosen, self.ranks, self.top_ids, self.top_values]


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """logits: float32 [N, vocab]; token_ids: long [N] on the same device, the token chosen at
    each row. ``k`` is capped at the vocabulary."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = min(k, logits.shape[-1])
    if k > 0:
        top = torch.topk(logprobs, k, dim=-1)
        top_values, top_ids = top.values, top.indices
    else:
        top_values = logprobs.new_empty(logits.shape[0], 0)
        top_ids = token_ids.new_empty(logits.shape[0], 0)
    return LogprobTensors(chosen[:, 0], ranks, top_ids, top_values)


def lists_from(token_ids: list[int], chosen: list[float], ranks: list[float],
               top_ids: list[float], top_values: list[float], k: int, width: int,
               rows: list[int] | None = None) -> LogprobsLists:
    """LogprobsLists for ``rows`` (default: all) out of values read back flat; ``width`` is the
    number of top columns that were computed, ``k`` how many of them the caller asked for."""
    rows = list(range(len(token_ids))) if rows is None else rows
    k = min(k, width)
    return LogprobsLists(
        token_ids=[token_ids[r] for r in rows],
        logprobs=[chosen[r] for r in rows],
        ranks=[int(ranks[r]) for r in rows],
        top_token_ids=[[int(t) for t in top_ids[r * width:r * width + k]] for r in rows],
        top_logprobs=[top_values[r * width:r * width + k] for r in rows])


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsLists:
    """logits: float32 [N, vocab]; token_ids: [N], the token chosen at each row. Each row's
    log-softmax at its token, that token's rank and the k most likely tokens, read back in one
    transfer."""
    tensors = logprob_tensors(logits, token_ids, k)
    ids, chosen, ranks, top_ids, top_values = read_back([token_ids, *tensors.as_list()])
    width = tensors.top_ids.shape[-1]
    return lists_from([int(t) for t in ids], chosen, ranks, top_ids, top_values, k, width)
