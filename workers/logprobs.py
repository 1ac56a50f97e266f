"""Log-probabilities from logits rows: the sampled token's (with its rank and the top k) and a
prompt's (each row scored against the token that follows it)."""

from __future__ import annotations

import torch

from engine.logprobs import LogprobsLists


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsLists:
    """logits: float32 [N, vocab]; token_ids: [N], the token chosen at each row. Each row's
    log-softmax at its token, that token's rank (1 = most likely; ties share the better rank)
    and the k most likely tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if k > 0:
        top = torch.topk(logprobs, k, dim=-1)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
    else:
        top_ids, top_lps = [[] for _ in token_ids], [[] for _ in token_ids]
    return LogprobsLists(token_ids=token_ids.tolist(), logprobs=chosen[:, 0].tolist(),
                         ranks=ranks.tolist(), top_token_ids=top_ids, top_logprobs=top_lps)
