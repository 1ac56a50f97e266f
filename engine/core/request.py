"""A request and its two counters (docs/design.md section 3)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from engine.logprobs import LogprobsLists
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output.matcher import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Something that belongs to this request alone failed (sampling, its logits, its stop
    # strings or detokenization): it ends, the engine and the other requests go on.
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One generation request.

    ``num_tokens`` counts prompt + generated tokens; ``num_computed_tokens`` counts those whose KV is
    in the cache. Prefill, chunked prefill, decode and resume after preemption are all "compute the
    tokens owed": ``num_tokens - num_computed_tokens``, plus ``num_output_placeholders``: tokens
    sampled by steps scheduled but not yet read back (one while a step that samples for it runs;
    two while async scheduling has the next step scheduled ahead).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    max_model_len: int | None = None
    # TTFT service-level objective; the deadline is arrival_time + ttft_slo_ms / 1000.
    ttft_slo_ms: float | None = None
    # Time-per-output-token objective: every gap between two output tokens should stay within it
    # (the scheduler keeps the decodes that have one within it; met when the mean gap is).
    tpot_slo_ms: float | None = None
    # Parallel samples of one prompt: the sibling whose prefill this one waits for, to find
    # the prompt's KV in the prefix cache (engine.core.sibling_gate).
    prefill_after: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Output tokens that scheduled steps will sample and the host has not read yet (see above).
    num_output_placeholders: int = 0
    # Preemptions of either kind (num_kv_preemptions + num_slo_preemptions).
    num_preemptions: int = 0
    # KV preemptions: evicted for KV space, to be recomputed.
    num_kv_preemptions: int = 0
    # SLO preemptions: the monitor stopped a pass for an urgent request (Rule 1: once
    # preempted, never a victim again).
    num_slo_preemptions: int = 0
    # Predicted prefill seconds of the waiters its steps were stopped for while it was aged
    # (monitor.policy.AGED_YIELD_SHARE bounds them).
    aged_yield_s: float = 0.0
    # Tokens served from the prefix cache at the first admission (-1 until admitted).
    num_cached_tokens: int = -1
    # Tokens of its prompt the prefix cache held when it arrived: until admission claims the
    # blocks, the prediction of what its prefill skips. A follow-up chat turn whose history is
    # cached prefills only its new message; ranked on its whole prompt it would look doomed.
    num_cached_prefix_tokens: int = 0
    # Chained hashes of this request's full blocks of tokens, extended as tokens are appended.
    block_hashes: list[bytes] = field(default_factory=list)
    # LongRoPE: its KV is rotated by the long factors (engine.core.long_rope); its block hashes
    # chain from the long regime's root.
    long_rope: bool = False
    first_scheduled_time: float | None = None
    # Deadline - now - predicted TTFT when first admitted (None: no deadline): how much room
    # the scheduler had, reported per request by the benchmark.
    slack_at_admission_s: float | None = None
    first_token_time: float | None = None
    # The consumer (the API server, the offline LLM, a benchmark) reports when the request's
    # first *visible* output reached its client (`EngineCore.note_first_output`): until then
    # the TTFT deadline stays live, whatever was sampled (a special token, a partial UTF-8
    # sequence and held-back stop-string text show nothing). Unset: the first sampled token
    # counts as delivered (a caller of EngineCore that reports nothing).
    reports_first_output: bool = False
    # When its first visible output reached the client (time.monotonic()), as reported.
    first_output_time: float | None = None
    # A mid-forward preemption was made for it: it streams as an interactive turn, its next
    # tokens kept within a gap of twice a decode step (engine.core.deadline_caps:
    # DeadlineCaps.cap_for_tpot).
    served_urgently: bool = False
    # When the latest output token was sampled: the next one is due tpot_slo_ms after it.
    last_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None
    # FINISHED_ERROR: a one-line reason, safe to show a client (tracebacks go to the log).
    error: str | None = None
    # The latest output token's logprobs (sampling_params.logprobs set).
    last_logprobs: LogprobsLists | None = None
    # Prompt tokens 1.. scored so far (sampling_params.prompt_logprobs set): complete, and sent,
    # with the first output token.
    prompt_logprobs: LogprobsLists | None = None
    # Structured outputs: its grammar state (set once compiled, before the scheduler sees it).
    grammar: RequestGrammar | None = None
    # What each step sends the workers: the parameters less the structured-output spec (a
    # schema need not cross to every rank every step; the step's bitmask carries its effect).
    step_sampling_params: SamplingParams = field(init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.step_sampling_params = (
            self.sampling_params if self.sampling_params.structured_outputs is None
            else msgspec.structs.replace(self.sampling_params, structured_outputs=None))
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = LogprobsLists()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_owed(self) -> int:
        # len() directly: read several times per request per step.
        return len(self.all_token_ids) + self.num_output_placeholders - self.num_computed_tokens

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling its next token reads its output so far on the host (penalties, a
        grammar's mask): it cannot be decoded before its last token is read back."""
        return self.grammar is not None or self.sampling_params.has_penalties

    def may_decode_ahead(self, max_model_len: int) -> bool:
        """Whether its next decode may be scheduled before the token in flight is read back:
        sampling reads no history, and the token in flight cannot end it by length (a decode
        past its limit would write KV beyond the table it may hold). Stop tokens and stop
        strings are seen a step late: the token computed ahead is then dropped."""
        pending = self.num_output_placeholders
        return (not self.needs_output_history
                and self.num_output_tokens + pending < self.sampling_params.max_tokens
                and self.num_tokens + pending < (self.max_model_len or max_model_len))

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def deadline(self) -> float | None:
        """time.monotonic() by which the first token is due, or None without an SLO."""
        return None if self.ttft_slo_ms is None else self.arrival_time + self.ttft_slo_ms / 1000

    @property
    def awaiting_first_output(self) -> bool:
        """Whether its client has yet to see its first output: its TTFT objective is still to
        be met (docs/design.md section 9). A request that finished without one is not waiting
        for it any more."""
        if self.first_token_time is None:
            return True
        return (self.reports_first_output and self.first_output_time is None
                and not self.is_finished)

    @property
    def live_deadline(self) -> float | None:
        """Its TTFT deadline while its first output is still owed to the client, else None."""
        return self.deadline if self.awaiting_first_output else None

    def append_output_token(self, token_id: int, logprobs: LogprobsLists | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.last_logprobs = logprobs

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens are still to be scored: its prefill must then compute every
        prompt position (no prefix-cache hits, which have no logits)."""
        return self.prompt_logprobs is not None and self.num_output_tokens == 0

    def prompt_logprob_targets(self, start: int, end: int) -> list[int]:
        """The prompt tokens the rows of chunk [start, end) are scored against: rows reach
        positions start..end-1 and each predicts the token after it. Empty when nothing is
        owed, or the chunk does not continue from the last scored position."""
        if not self.needs_prompt_logprobs or len(self.prompt_logprobs) != start:
            return []
        return self.prompt_token_ids[start + 1:min(end + 1, self.num_prompt_tokens)]

    def add_prompt_logprobs(self, chunk: LogprobsLists) -> None:
        assert self.prompt_logprobs is not None
        self.prompt_logprobs.extend(chunk)

    def restart_prompt_logprobs(self) -> None:
        """A recompute preemption before the first token: the prompt is scored again from the
        start (the scores so far were never sent)."""
        if self.needs_prompt_logprobs:
            self.prompt_logprobs = LogprobsLists()
