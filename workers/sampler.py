"""Token sampling: logits processors (workers.logits_processors), greedy, temperature, min-p,
top-k, top-p, per-request seeds, and the sampled tokens' logprobs.

Seeded draws are derived from (seed, index of the token in the output), not from a generator that
lives across steps: a request's tokens then do not depend on how it was batched, preempted,
recomputed or rolled back, and no per-request state has to follow it between workers.

Each row is sampled under its own guard: a row that cannot be sampled (the model produced NaN or
inf for it, or a draw raised) fails that row only, and the other rows of the batch keep the
tokens they would have had without it (docs/design.md section 6: nothing one request does can
fail the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.logprobs import LogprobsLists
from engine.sampling_params import SamplingParams
from workers.logits_processors import (NO_HISTORY, TokenHistory, min_p_filter, needs_processing,
                                       process_logits)
from workers.logprobs import logprobs_of

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs map to distinct generator seeds


class NonFiniteLogits(ValueError):
    """A request's logits row holds NaN or +inf, or only -inf: no token can be chosen from it."""


@dataclass
class SamplerOutput:
    # One entry per row: the sampled token, or None where the row failed.
    token_ids: list[int | None]
    # Row -> the exception that failed it (the caller knows which request a row is, and logs).
    errors: dict[int, Exception] = field(default_factory=dict)
    # Row -> the sampled token's logprobs, for the rows whose parameters ask for them.
    logprobs: dict[int, LogprobsLists] = field(default_factory=dict)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # For unseeded random requests: one engine-wide stream, on the logits' device
        # (torch.multinomial draws from a generator on the tensor's own device).
        self._generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int],
                 histories: list[TokenHistory] | None = None) -> SamplerOutput:
        """logits: float32 [N, vocab], one row per request to sample; ``histories``: what each
        row's logits processors read (default: nothing)."""
        # A row whose maximum is not finite holds NaN (amax propagates it), +inf, or nothing but
        # -inf: the forward pass broke down for it (argmax would happily return a NaN's index).
        # One reduction, no [N, vocab] temporaries; both read back in one transfer (one device
        # sync on a GPU).
        tokens: list[int | None]
        broken, tokens = torch.stack([(~torch.isfinite(logits.amax(dim=-1))).long(),
                                      logits.argmax(dim=-1)]).tolist()
        out = SamplerOutput(tokens)
        for row, (sp, index) in enumerate(zip(params, output_indices)):
            try:
                if broken[row]:
                    raise NonFiniteLogits("the model produced non-finite logits (NaN or "
                                          "inf) for this request")
                row_logits = logits[row]
                history = histories[row] if histories is not None else NO_HISTORY
                if needs_processing(sp, history):
                    row_logits = process_logits(row_logits, sp, history)
                    if sp.greedy:
                        tokens[row] = _argmax(row_logits)
                if not sp.greedy:
                    tokens[row] = self._sample_row(row_logits, sp, index)
                if sp.logprobs is not None:
                    # After the processors and temperature, before the filters (SamplingParams).
                    scaled = row_logits if sp.greedy else row_logits / sp.temperature
                    chosen = torch.tensor([tokens[row]], device=logits.device)
                    out.logprobs[row] = logprobs_of(scaled[None], chosen, sp.logprobs)
            except Exception as exc:  # one request's failure, not the batch's
                tokens[row] = None
                out.errors[row] = exc
        return out

    def _sample_row(self, logits: torch.Tensor, sp: SamplingParams, index: int) -> int:
        logits = logits / sp.temperature
        if 0 < sp.top_k < logits.numel():
            kth = torch.topk(logits, sp.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.min_p > 0.0:
            probs = min_p_filter(probs, sp.min_p)
        if sp.top_p < 1.0:
            probs = _top_p_filter(probs, sp.top_p)
        # Checked here rather than left to multinomial: on a GPU an invalid distribution is a
        # device-side assert that poisons the whole CUDA context, not one row's exception.
        total = float(probs.sum())
        if not 0.0 < total < float("inf"):
            raise ValueError(f"no token can be sampled: the filtered probabilities sum to {total}")
        if sp.seed is not None:
            generator = torch.Generator(probs.device)
            generator.manual_seed((sp.seed * _SEED_STRIDE + index) % 2**63)
        else:
            generator = self._generator
        return int(torch.multinomial(probs, 1, generator=generator).item())


def _argmax(logits: torch.Tensor) -> int:
    """Greedy over processed logits: the processors can leave a row with nothing allowed."""
    best = int(logits.argmax())
    if not torch.isfinite(logits[best]):
        raise ValueError("no token can be chosen: logit_bias and the stop-token mask leave none")
    return best


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p
    # Explicitly, since a tiny top_p rounds to 0 in float32 and would drop every token.
    drop[0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return filtered / filtered.sum()
