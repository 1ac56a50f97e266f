"""Token sampling: logits processors (workers.sample.logits_processors), greedy, temperature, min-p,
top-k, top-p, per-request seeds, and the sampled tokens' logprobs.

A batch costs ONE device-to-host read, whatever its size and mix of parameters: the tokens, what
each row needs to tell whether it could be sampled, and the logprobs are read back together
(workers.host_transfer). On a GPU each read waits for the device, and the engine reads the
tokens every step, so a read per row would add directly to the time per token. The
per-row parameters go up in one non-blocking copy. A call is two halves: ``launch`` queues the
draws and starts that read, ``PendingSample.finish`` waits for it and builds the output, so that
the host can queue the next step, fed by the sampled ids still on the device, in between.

Random rows are sampled together with the exponential race: with ``q`` drawn from Exponential(1)
independently per token, ``argmax(p / q)`` is distributed as ``p`` (the Gumbel-max trick), so a
draw needs no cumulative sum, no search and no read of the distribution on the host. The filters
(top-k, min-p, top-p) set the logits of the tokens they drop to -inf before the race; only a
batch with a top-p row sorts (once, every random row together), and one with a top-k row but no
top-p takes a ``topk`` as wide as its largest k.

Seeded draws are derived from (seed, index of the token in the output), not from a generator that
lives across steps: a request's tokens then do not depend on how it was batched, preempted,
recomputed or rolled back, and no per-request state has to follow it between workers. A seeded
row's uniforms come from its own generator; everything after that is elementwise or per row, so
the other rows of the batch cannot change its token.

Each row fails alone (docs/design.md section 6: nothing one request does can fail the engine):
a row whose logits are not finite, whose processors leave nothing to choose, or whose filters
leave nothing to sample is flagged on the device and fails its request when the flags come back
with the tokens; an exception in a row's own host-side work (its processors, its seeded draw)
fails that row only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.logprobs import LogprobsLists
from engine.sampling_params import SamplingParams
from workers.host_transfer import PendingRead, start_read_back, upload
from workers.sample.logits_processors import (NO_HISTORY, TokenHistory, mask_disallowed,
                                              needs_processing, process_logits)
from workers.sample.logprobs import LogprobTensors, lists_from, logprob_tensors

_SEED_STRIDE = 1_000_003  # a prime, so (seed, index) pairs map to distinct generator seeds
# The largest float32: a larger temperature would become inf on the device, and -inf / inf is NaN.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max
# Uniforms of exactly 0 would make q infinite and tie a kept token with the dropped ones.
_TINY = torch.finfo(torch.float32).tiny


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


@dataclass
class PendingSample:
    """A batch sampled on the device and not yet read (``Sampler.launch``)."""

    # The sampled token ids, one per row, on the logits' device (a failed row's entry is
    # whatever the draw left): the next step's input where it was scheduled before they were
    # read back (async scheduling).
    tokens: torch.Tensor
    _read: PendingRead
    _params: list[SamplingParams]
    # Rows the host-side work failed already (processors, seeded draws).
    _errors: dict[int, Exception]
    _logprob_rows: list[int]
    _top_width: int

    def finish(self) -> SamplerOutput:
        """Wait for the values and assemble the output; called once."""
        return _assemble(self._read.values(), self._params, self._errors, self._logprob_rows,
                         self._top_width)


@dataclass
class _RandomRows:
    """The random (temperature > 0) rows of a batch, unseeded ones first: the engine-wide
    generator fills their uniforms in one draw."""

    rows: list[int]
    num_unseeded: int
    # Per row; the neutral value where the row has no such filter.
    temperature: list[float]
    top_k_index: list[float]  # k - 1, or -1: no top-k
    log_min_p: list[float]    # log(min_p), or -inf: no min-p
    top_p: list[float]        # top_p, or inf: no top-p

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int) -> _RandomRows:
        rows = ([r for r, sp in enumerate(params) if not sp.greedy and sp.seed is None]
                + [r for r, sp in enumerate(params) if not sp.greedy and sp.seed is not None])
        plan = cls(rows, sum(params[r].seed is None for r in rows), [], [], [], [])
        for row in rows:
            sp = params[row]
            plan.temperature.append(min(sp.temperature, _MAX_TEMPERATURE))
            plan.top_k_index.append(sp.top_k - 1 if 0 < sp.top_k < vocab else -1)
            plan.log_min_p.append(math.log(sp.min_p) if sp.min_p > 0.0 else -math.inf)
            plan.top_p.append(sp.top_p if sp.top_p < 1.0 else math.inf)
        return plan

    @property
    def max_top_k(self) -> int:
        return int(max(self.top_k_index, default=-1)) + 1

    @property
    def any_min_p(self) -> bool:
        return any(v > -math.inf for v in self.log_min_p)

    @property
    def any_top_p(self) -> bool:
        return any(v < math.inf for v in self.top_p)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # For unseeded random requests: one engine-wide stream, on the logits' device.
        self._generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int],
                 histories: list[TokenHistory] | None = None) -> SamplerOutput:
        """logits: float32 [N, vocab], one row per request to sample; ``histories``: what each
        row's logits processors read (default: nothing)."""
        return self.launch(logits, params, output_indices, histories).finish()

    def launch(self, logits: torch.Tensor, params: list[SamplingParams],
               output_indices: list[int],
               histories: list[TokenHistory] | None = None) -> PendingSample:
        """The device half of a call: the draws are queued and their read-back started, and
        the host does not wait for them (on a GPU). ``finish()`` on the result reads them."""
        num_rows, vocab = logits.shape
        errors: dict[int, Exception] = {}
        work = self._processed(logits, params, histories, errors)
        random = _RandomRows.of(params, vocab)
        logprob_rows = [r for r, sp in enumerate(params) if sp.logprobs is not None]
        (random_rows, temperature, top_k_index, log_min_p, top_p, logprob_index,
         logprob_temperature) = upload(
            [random.rows, random.temperature, random.top_k_index, random.log_min_p, random.top_p,
             logprob_rows, [1.0 if params[r].greedy else min(params[r].temperature,
                                                             _MAX_TEMPERATURE)
                            for r in logprob_rows]], logits.device)

        # A row whose maximum is not finite holds NaN (amax propagates it), +inf, or nothing but
        # -inf: the forward pass broke down for it (argmax would happily return a NaN's index).
        raw_peak = logits.amax(dim=-1)
        # What each row's token was chosen from peaks here; not finite: nothing to choose.
        peak = raw_peak if work is logits else work.amax(dim=-1)
        if len(random.rows) < num_rows:
            tokens = work.argmax(dim=-1)
        else:
            tokens = torch.zeros(num_rows, dtype=torch.long, device=logits.device)
        if random.rows:
            index = random_rows.long()
            # In place where it can: on a CPU each fresh [rows, vocab] buffer costs page faults.
            scaled = work.index_select(0, index).div_(temperature.float()[:, None])
            masked = _filtered(scaled, random, top_k_index.long(), log_min_p.float(),
                               top_p.float())
            uniforms = self._uniforms(masked, random, params, output_indices, errors)
            drawn, drawn_peak = _race(masked, uniforms)
            tokens = tokens.index_copy(0, index, drawn)
            peak = peak.index_copy(0, index, drawn_peak)

        lp: LogprobTensors | None = None
        max_k = max((params[r].logprobs or 0 for r in logprob_rows), default=0)
        if logprob_rows:
            # After the processors and temperature, before the filters (SamplingParams).
            lp_index = logprob_index.long()
            scaled_for_logprobs = (work.index_select(0, lp_index)
                                   / logprob_temperature.float()[:, None])
            lp = logprob_tensors(scaled_for_logprobs, tokens.index_select(0, lp_index), max_k)
        read = start_read_back([tokens, raw_peak, peak,
                                *(lp.as_list() if lp is not None else [])])
        return PendingSample(tokens, read, params, errors, logprob_rows,
                             lp.top_ids.shape[-1] if lp is not None else 0)

    @staticmethod
    def _processed(logits: torch.Tensor, params: list[SamplingParams],
                   histories: list[TokenHistory] | None,
                   errors: dict[int, Exception]) -> torch.Tensor:
        """The logits after the grammars' masks and each row's processors (the input itself
        when no row has any). A row whose processors raise keeps its raw logits and fails."""
        work = logits
        rows = histories if histories is not None else [NO_HISTORY] * len(params)
        masked = [row for row, history in enumerate(rows)
                  if history.allowed_token_bitmask is not None]
        if masked:
            try:
                work = mask_disallowed(logits, masked,
                                       [rows[row].allowed_token_bitmask or b"" for row in masked])
            except Exception as exc:  # the constrained rows' failure, not the batch's
                errors.update((row, exc) for row in masked)
        for row, (sp, history) in enumerate(zip(params, rows)):
            if row in errors or not needs_processing(sp, history):
                continue
            try:
                row_logits = process_logits(work[row], sp, history)
            except Exception as exc:  # one request's failure, not the batch's
                errors[row] = exc
                continue
            if work is logits:
                work = logits.clone()
            work[row] = row_logits
        return work

    def _uniforms(self, masked: torch.Tensor, random: _RandomRows, params: list[SamplingParams],
                  output_indices: list[int], errors: dict[int, Exception]) -> torch.Tensor:
        """Uniform [0, 1) draws, one per token of each random row: the unseeded rows' from the
        engine-wide generator in one draw, each seeded row's from its own generator."""
        uniforms = torch.empty_like(masked)
        if random.num_unseeded:
            uniforms[:random.num_unseeded].uniform_(generator=self._generator)
        for i in range(random.num_unseeded, len(random.rows)):
            row = random.rows[i]
            try:
                self._seeded_uniforms(uniforms[i], params[row], output_indices[row])
            except Exception as exc:  # one request's failure, not the batch's
                errors[row] = exc
                uniforms[i] = 0.5  # anything finite: the row's token is discarded
        return uniforms

    @staticmethod
    def _seeded_uniforms(out: torch.Tensor, sp: SamplingParams, index: int) -> None:
        """Fill one row's uniforms from a generator that depends only on (seed, index)."""
        generator = torch.Generator(out.device)
        generator.manual_seed((sp.seed * _SEED_STRIDE + index) % 2**63)
        out.uniform_(generator=generator)


def _filtered(scaled: torch.Tensor, random: _RandomRows, top_k_index: torch.Tensor,
              log_min_p: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scaled`` (logits after temperature, one row per random row) with -inf at the tokens
    that top-k, min-p and top-p drop. Definitions as the per-row sampler had them: top-k keeps
    the tokens at least as likely as the k-th; min-p drops those less likely than min_p times the
    most likely one; top-p then keeps the smallest set of most likely tokens, over what is left,
    whose mass reaches top_p (always the most likely one). Rows without a filter get a neutral
    parameter, so the kept set of a row never depends on the other rows."""
    sorted_values = order = None
    if random.any_top_p:
        # Stable, so that tied tokens are ordered by id whatever the batch.
        sorted_values, order = scaled.sort(dim=-1, descending=True, stable=True)
    threshold: torch.Tensor | None = None
    if random.max_top_k:
        ranked = (sorted_values if sorted_values is not None
                  else scaled.topk(random.max_top_k, dim=-1).values)
        kth = ranked.gather(1, top_k_index.clamp(min=0)[:, None])
        threshold = kth.masked_fill(top_k_index[:, None] < 0, -math.inf)
    if random.any_min_p:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p): no softmax needed.
        floor = scaled.amax(dim=-1, keepdim=True) + log_min_p[:, None]
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    masked = scaled if threshold is None else scaled.masked_fill(scaled < threshold, -math.inf)
    if sorted_values is not None:
        if threshold is not None:
            sorted_values = sorted_values.masked_fill(sorted_values < threshold, -math.inf)
        probs = sorted_values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= top_p[:, None]
        # Explicitly, since a tiny top_p rounds to 0 in float32 and would drop every token.
        drop[:, 0] = False
        masked = masked.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), -math.inf)
    return masked


def _race(masked: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row drawn from softmax(masked) by the exponential race, and each row's
    largest kept logit (not finite: the filtered probabilities are NaN, nothing to sample)."""
    peak = masked.amax(dim=-1, keepdim=True)
    exponential = uniforms.clamp_min_(_TINY).log_().neg_()
    # exp(masked - peak) is p up to the row's normaliser, which argmax does not need; dropped
    # tokens have p = 0 and lose to the most likely token, whose key is at least 1 / 87.
    # (``masked`` is the sampler's own copy, needed no more: overwritten in place.)
    keys = masked.sub_(peak).exp_().div_(exponential)
    return keys.argmax(dim=-1), peak[:, 0]


def _assemble(values: list[list[float]], params: list[SamplingParams],
              errors: dict[int, Exception], logprob_rows: list[int],
              top_width: int) -> SamplerOutput:
    """The output from the values read back: tokens, then the errors the flags say, in the
    order the per-row sampler checked them (the raw logits first)."""
    tokens, raw_peak, peak = values[0], values[1], values[2]
    out = SamplerOutput([int(t) for t in tokens])
    for row, sp in enumerate(params):
        try:
            _check_row(raw_peak[row], peak[row], sp, errors.get(row))
        except Exception as exc:  # raised, so that the log shows where (as the caller logs it)
            out.token_ids[row] = None
            out.errors[row] = exc
    if logprob_rows:
        chosen, ranks, top_ids, top_values = values[3:]
        chosen_tokens = [out.token_ids[row] for row in logprob_rows]
        for i, row in enumerate(logprob_rows):
            if chosen_tokens[i] is not None:
                out.logprobs[row] = lists_from(chosen_tokens, chosen, ranks, top_ids, top_values,
                                               params[row].logprobs or 0, top_width, rows=[i])
    return out


def _check_row(raw_peak: float, peak: float, sp: SamplingParams,
               host_error: Exception | None) -> None:
    """Raise what failed the row, if anything: its raw logits, then its host-side work, then
    what its processors and filters left."""
    if not math.isfinite(raw_peak):
        raise NonFiniteLogits("the model produced non-finite logits (NaN or inf) for this "
                              "request")
    if host_error is not None:
        raise host_error
    if math.isfinite(peak):
        return
    if sp.greedy:
        # Only the processors can take every token away from a row whose logits are finite.
        raise ValueError("no token can be chosen: the grammar (structured outputs), "
                         "logit_bias and the stop-token mask leave none")
    raise ValueError(f"no token can be sampled: the filtered probabilities sum to nan (the "
                     f"largest logit left after temperature and the filters is {peak})")
