"""Outputs: what EngineCore emits per step, and what users of the engine receive."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from engine.logprobs import LogprobsLists, PositionLogprobs


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """New tokens for one request from one engine step (crosses the EngineCore process boundary)."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # finish_reason "error": a one-line reason for the client (the traceback is in the log).
    error: str | None = None
    # Both kinds (deprecated in responses: num_kv_preemptions + num_slo_preemptions).
    num_preemptions: int = 0
    num_kv_preemptions: int = 0
    num_slo_preemptions: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # The scheduler's slack when it first admitted the request (None: no deadline, not yet).
    slack_at_admission_s: float | None = None
    # The new token's logprobs (sampling_params.logprobs set).
    new_logprobs: LogprobsLists | None = None
    # Every prompt token's but the first (sampling_params.prompt_logprobs set), with the first
    # output token.
    prompt_logprobs: LogprobsLists | None = None


class SchedulerStats(msgspec.Struct, kw_only=True):
    """A snapshot of the scheduler for gauges (counters are cumulative since start)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_kv_preemptions: int = 0
    # SLO preemptions applied to a victim (the monitor stopped a pass for an urgent request).
    num_slo_preemptions: int = 0
    # Tokens handed to the model so far, unwound steps included.
    num_scheduled_tokens: int = 0
    # Scheduled tokens of unwound steps, and the layers they had run: work thrown away.
    slo_preempt_wasted_tokens: int = 0
    slo_preempt_wasted_layers: int = 0
    # Monitor decision -> unwind seen by EngineCore, for unwinds since the previous snapshot.
    slo_preempt_latencies_s: list[float] = []
    # Engine steps scheduled so far (the last step id).
    num_steps: int = 0
    # Exceptions the SLO monitor thread caught and survived.
    monitor_errors: int = 0
    # The TTFT predictor's safety margin: how far from predicted recent steps ran, either way.
    ttft_predictor_relative_error: float = 0.0
    # The TTFT predictor's step model as it stands (monitor.step_time_model.StepTimeModel's
    # fields, as `sloserve calibrate` writes them): what this engine now believes a step costs
    # on this machine, drift followed (/debug/stats).
    ttft_model: dict[str, float | bool | None] = {}


def error_line(exc: BaseException, limit: int = 200) -> str:
    """A request's error as a client may see it: the exception's type and first line, bounded
    (the traceback goes to the server log, never into a response)."""
    lines = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return message if len(message) <= limit else message[:limit - 3] + "..."


@dataclass
class RequestMetrics:
    """Timestamps are time.monotonic() seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Both kinds (deprecated in responses: num_kv_preemptions + num_slo_preemptions).
    num_preemptions: int = 0
    # KV preemptions (evicted for KV space) and SLO preemptions (its pass stopped for an
    # urgent request).
    num_kv_preemptions: int = 0
    num_slo_preemptions: int = 0
    num_cached_tokens: int = 0
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    num_output_tokens: int = 0
    # Deadline - first admission - predicted TTFT, seconds: how much room the scheduler had
    # (None without a TTFT SLO, or before the request was admitted).
    slack_at_admission_s: float | None = None
    # The API server's responses stamp the first token (and the finish) where the client is
    # sent it (engine.serving.edge_clock); the engine's own first-token stamp stays here.
    engine_first_token_time: float | None = None
    # The first token of the answer sent to the client: after a reasoning model's thinking,
    # its content or tool call (engine.serving.edge_clock); the first token itself otherwise.
    first_answer_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_slo_met(self) -> bool | None:
        if self.ttft_slo_ms is None or self.ttft is None:
            return None
        return self.ttft * 1000 <= self.ttft_slo_ms

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT), once finished."""
        if self.finish_time is None or self.first_token_time is None \
                or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def tpot_slo_met(self) -> bool | None:
        """None without an objective or before the request finished; a request with one output
        token has no gap to miss."""
        if self.tpot_slo_ms is None or self.finish_time is None or self.first_token_time is None:
            return None
        tpot = self.tpot
        return tpot is None or tpot * 1000 <= self.tpot_slo_ms

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_to_first_answer(self) -> float | None:
        """Arrival to the first answer token sent (None: no answer, or not stamped)."""
        if self.first_answer_time is None:
            return None
        return self.first_answer_time - self.arrival_time

    @property
    def engine_ttft(self) -> float | None:
        """Arrival to the engine's first-token stamp; ttft minus this is what detokenization,
        IPC and the API server's event loop added (None where first_token_time is the
        engine's own)."""
        if self.engine_first_token_time is None:
            return None
        return self.engine_first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # finish_reason "error": why this request failed (the other requests were not affected).
    error: str | None = None
    metrics: RequestMetrics | None = None
    # sampling_params.logprobs set: per output token, the chosen token and the top
    # alternatives (vLLM's shape), and the sum of the chosen tokens' logprobs.
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    # sampling_params.prompt_logprobs set: per prompt token, None for the first (nothing
    # precedes it), once the first output token exists.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Where each output token's text starts in `text` (OpenAI's text_offset; logprobs only).
    text_offsets: list[int] | None = None
    # n > 1 (offline API): every sample of the prompt, this one first; empty for n = 1.
    samples: list[RequestOutput] = field(default_factory=list)

    @property
    def outputs(self) -> list[RequestOutput]:
        """The prompt's samples, as vLLM's ``RequestOutput.outputs`` (``[self]`` for n = 1)."""
        return self.samples or [self]


def best_samples(samples: list[RequestOutput], n: int, keep_logprobs: bool
                 ) -> list[RequestOutput]:
    """best_of: the n samples with the highest cumulative logprob, best first (failed ones
    last). ``keep_logprobs`` False: the per-token logprobs computed only to rank are dropped."""
    def score(out: RequestOutput) -> float:
        if out.finish_reason == "error" or out.cumulative_logprob is None:
            return float("-inf")
        return out.cumulative_logprob

    best = sorted(samples, key=score, reverse=True)[:n]
    if not keep_logprobs:
        for out in best:
            out.logprobs = out.text_offsets = None
    return best
