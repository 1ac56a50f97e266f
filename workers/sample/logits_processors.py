"""What a request's sampling parameters do to its logits before temperature: its grammar's
mask (structured outputs), logit_bias, the min_tokens mask and the penalties (vLLM's order, and
vLLM's / OpenAI's definitions).

The worker keeps no per-request state: the scheduler sends each sampling row the token history
the penalties need (``TokenHistory``), so a rollback or preemption has nothing here to undo.

The grammar masks go on for the whole batch at once (``mask_disallowed``: one upload and a fixed
handful of kernels, whatever the number of constrained rows): agents' requests are often all
constrained, and on the H100 a mask applied row by row (a dozen launches and a blocking copy
each) made a batch of 16 decode 35% slower (2026-11-28). The other processors stay per row (few
requests use them), but no row waits for the device: token ids go up without a blocking copy
(workers.host_transfer), and counts are scattered rather than ``bincount``ed (which reads the
largest id back on a GPU).
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
    """Whether ``process_logits`` changes this row (the grammar's mask is ``mask_disallowed``)."""
    return sp.processes_logits or bool(history.blocked_token_ids)


def process_logits(logits: torch.Tensor, sp: SamplingParams,
                   history: TokenHistory) -> torch.Tensor:
    """A processed copy of one row of float32 logits [vocab], after its grammar's mask (vLLM's
    order: a bias or a penalty then ranks only what the grammar allows). Raises ValueError for
    a token id beyond the vocabulary (only this request fails)."""
    vocab = logits.shape[-1]
    logits = logits.clone()
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


def mask_disallowed(logits: torch.Tensor, rows: Sequence[int],
                    bitmasks: Sequence[bytes]) -> torch.Tensor:
    """A copy of ``logits`` [N, vocab] in which each of ``rows`` has the tokens its grammar
    refuses (``bitmasks``, one per row) at -inf. Raises ValueError for masks of unequal or
    ragged widths (every row of a batch is masked for the same vocabulary)."""
    allowed = allowed_tokens(bitmasks, logits.shape[-1], logits.device)
    index = upload_ids(rows, logits.device)
    refused_masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, refused_masked)


def allowed_tokens(bitmasks: Sequence[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """A bool [len(bitmasks), vocab] tensor from packed bits (bit t % 32 of int32 word t // 32
    of each row), uploaded in one copy and unpacked on the device; tokens past the masks' width
    (a vocabulary padded beyond the tokenizer's) are not allowed."""
    widths = {len(mask) for mask in bitmasks}
    if len(widths) != 1 or next(iter(widths)) % 4:
        raise ValueError(f"grammar bitmasks must share one width in whole int32 words, got "
                         f"{sorted(widths)} bytes")
    host = torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.int32)
    words = upload_tensor(host.view(len(bitmasks), -1), device)
    # Made on the device: a host tensor's ordinary copy would wait for the forward pass.
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).flatten(1).bool()
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)


def _token_tensor(ids: Sequence[int], vocab: int, what: str,
                  device: torch.device) -> torch.Tensor:
    if ids and max(ids) >= vocab:
        raise ValueError(f"{what} id {max(ids)} is outside the vocabulary (size {vocab})")
    return upload_ids(ids, device)
