"""What a request's sampling parameters do to its logits before temperature: its grammar's
mask (structured outputs), logit_bias, the min_tokens mask and the penalties (vLLM's order, and
vLLM's / OpenAI's definitions).

The worker keeps no per-request state: the scheduler sends each sampling row the token history
the penalties need (``TokenHistory``), so a rollback or preemption has nothing here to undo.

Processing stays per row (few requests use these parameters), but no row waits for the device:
token ids go up without a blocking copy (workers.host_transfer), and counts are scattered rather
than ``bincount``ed (which reads the largest id back on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from workers.host_transfer import upload, upload_ids, upload_tensor


@dataclass(frozen=True)
class TokenHistory:
    """What one sampling row's processors read (empty where its parameters need nothing)."""

    # Repetition penalty: tokens of the prompt and of the output; frequency and presence: the
    # output's.
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    # Never sampled this step (EOS and stop_token_ids while fewer than min_tokens exist).
    blocked_token_ids: Sequence[int] = ()
    # Structured outputs: the tokens the request's grammar allows (engine.structured_output).
    allowed_token_bitmask: bytes | None = None


NO_HISTORY = TokenHistory()


def needs_processing(sp: SamplingParams, history: TokenHistory) -> bool:
    return (sp.processes_logits or bool(history.blocked_token_ids)
            or history.allowed_token_bitmask is not None)


def process_logits(logits: torch.Tensor, sp: SamplingParams,
                   history: TokenHistory) -> torch.Tensor:
    """A processed copy of one row of float32 logits [vocab]. Raises ValueError for a token id
    beyond the vocabulary (only this request fails)."""
    vocab = logits.shape[-1]
    logits = logits.clone()
    if history.allowed_token_bitmask is not None:
        # First, as vLLM applies it: a bias or a penalty then ranks only what the grammar allows.
        logits.masked_fill_(~allowed_tokens(history.allowed_token_bitmask, vocab, logits.device),
                            float("-inf"))
    if sp.logit_bias:
        ids = _token_tensor(list(sp.logit_bias), vocab, "logit_bias", logits.device)
        (biases,) = upload([list(sp.logit_bias.values())], logits.device)
        logits.index_add_(0, ids, biases.to(logits.dtype))
    if history.blocked_token_ids:
        blocked = _token_tensor(history.blocked_token_ids, vocab, "stop token", logits.device)
        logits[blocked] = float("-inf")
    if sp.has_penalties:
        output = _token_tensor(history.output_token_ids, vocab, "output token", logits.device)
        counts = torch.zeros_like(logits).index_add_(
            0, output, torch.ones(output.shape, dtype=logits.dtype, device=logits.device))
        if sp.repetition_penalty != 1.0:
            prompt = _token_tensor(history.prompt_token_ids, vocab, "prompt token",
                                   logits.device)
            seen = counts > 0
            seen[prompt] = True
            # CTRL's penalty (as vLLM and HF): a seen token's logit moves toward -inf whatever
            # its sign.
            penalized = torch.where(logits > 0, logits / sp.repetition_penalty,
                                    logits * sp.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    return logits


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """A bool [vocab] tensor from packed bits (bit t % 32 of int32 word t // 32), unpacked on
    the device; tokens past the mask's width (a vocabulary padded beyond the tokenizer's) are
    not allowed."""
    words = upload_tensor(torch.frombuffer(bytearray(bitmask), dtype=torch.int32), device)
    bits = ((words[:, None] >> _BIT_SHIFTS.to(words.device)) & 1).flatten().bool()
    if bits.shape[0] >= vocab:
        return bits[:vocab]
    return torch.cat([bits, bits.new_zeros(vocab - bits.shape[0])])


def _token_tensor(ids: Sequence[int], vocab: int, what: str,
                  device: torch.device) -> torch.Tensor:
    if ids and max(ids) >= vocab:
        raise ValueError(f"{what} id {max(ids)} is outside the vocabulary (size {vocab})")
    return upload_ids(ids, device)
