"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Seeded draws are derived from (seed, index of the token in the output), not from a generator that
lives across steps: a request's tokens then do not depend on how it was batched, preempted,
recomputed or rolled back, and no per-request state has to follow it between workers.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs map to distinct generator seeds


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # For unseeded random requests: one engine-wide stream, on the logits' device
        # (torch.multinomial draws from a generator on the tensor's own device).
        self._generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> list[int]:
        """logits: float32 [N, vocab], one row per request to sample."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, (sp, index) in enumerate(zip(params, output_indices)):
            if not sp.greedy:
                tokens[row] = self._sample_row(logits[row], sp, index)
        return tokens

    def _sample_row(self, logits: torch.Tensor, sp: SamplingParams, index: int) -> int:
        logits = logits / sp.temperature
        if 0 < sp.top_k < logits.numel():
            kth = torch.topk(logits, sp.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.top_p < 1.0:
            probs = _top_p_filter(probs, sp.top_p)
        if sp.seed is not None:
            generator = torch.Generator(probs.device)
            generator.manual_seed((sp.seed * _SEED_STRIDE + index) % 2**63)
        else:
            generator = self._generator
        return int(torch.multinomial(probs, 1, generator=generator).item())


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always the top one)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return filtered / filtered.sum()
