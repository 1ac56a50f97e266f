"""Reference implementations of the sampling parameters (test helper): the logits processors
loop by loop, as their OpenAI / vLLM definitions read, and a greedy loop over the Hugging Face
model with them."""

from __future__ import annotations

import math

import torch

from engine.sampling_params import SamplingParams


def _reference(logits: list[float], sp: SamplingParams, prompt: list[int], output: list[int],
               blocked: list[int]) -> list[float]:
    out = list(logits)
    for token, bias in sp.logit_bias.items():
        out[token] += bias
    for token in blocked:
        out[token] = -math.inf
    for token in range(len(out)):
        if token in prompt or token in output:
            rp = sp.repetition_penalty
            out[token] = out[token] / rp if out[token] > 0 else out[token] * rp
        count = output.count(token)
        out[token] -= sp.frequency_penalty * count
        if count:
            out[token] -= sp.presence_penalty
    return out


PROMPT = [5, 17, 42, 42, 99, 3, 17, 250, 8, 8, 61]


def _reference_greedy(hf, sp: SamplingParams, eos: int | None,
                      prompt: list[int] = PROMPT) -> list[int]:
    """Greedy decoding over the HF model with the reference logits processors."""
    output: list[int] = []
    for _ in range(sp.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + output])).logits[0, -1].float()
        blocked = []
        if len(output) < sp.min_tokens:
            blocked = list(sp.stop_token_ids) + ([eos] if eos is not None else [])
        processed = _reference(logits.tolist(), sp, prompt, output, blocked)
        token = max(range(len(processed)), key=processed.__getitem__)
        output.append(token)
        if token in sp.stop_token_ids and len(output) >= sp.min_tokens:
            break
    return output
