"""Frontend side of a request: turns EngineCore token outputs into text and finished outputs.

Stop strings are checked here, where the text is; a hit finishes the request and the caller tells
EngineCore to drop it (the same split as vLLM v1, so the API server can own detokenization).

An exception while handling one request's output (its detokenizer, its stop strings) finishes that
request with finish_reason "error" and the caller aborts it in EngineCore; the other requests of
the same batch are processed as usual.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.processing.detokenizer import IncrementalDetokenizer
from engine.logprobs import to_positions
from engine.outputs import EngineCoreOutput, RequestMetrics, RequestOutput, error_line
from engine.sampling_params import SamplingParams


logger = logging.getLogger(__name__)


@dataclass
class ProcessedOutputs:
    # The updated outputs, finished ones included.
    outputs: list[RequestOutput] = field(default_factory=list)
    # Finished here by a stop string: the caller tells EngineCore to stop them.
    stopped: list[str] = field(default_factory=list)
    # Failed here (detokenization, stop strings): the caller aborts them in EngineCore.
    failed: list[str] = field(default_factory=list)


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer | None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._token_texts: dict[int, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    ttft_slo_ms: float | None = None, tpot_slo_ms: float | None = None) -> None:
        detokenizer = None
        if self._tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        output = RequestOutput(request_id=request_id, prompt=prompt,
                               prompt_token_ids=prompt_token_ids,
                               metrics=RequestMetrics(arrival_time=arrival_time,
                                                      ttft_slo_ms=ttft_slo_ms,
                                                      tpot_slo_ms=tpot_slo_ms))
        if params.logprobs is not None:
            output.logprobs, output.cumulative_logprob, output.text_offsets = [], 0.0, []
        self._states[request_id] = _RequestState(output, detokenizer)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one engine step's outputs. Finished requests are forgotten."""
        result = ProcessedOutputs()
        for core_out in core_outputs:
            state = self._states.get(core_out.req_id)
            if state is None:  # finished here already (stop string) before the core heard of it
                continue
            try:
                stopped = self._apply(state, core_out)
            except Exception as exc:  # this request's failure, not the batch's
                logger.error("request %s: processing its output failed; the request is "
                             "finished with an error", core_out.req_id, exc_info=exc)
                _fail(state.output, f"detokenization failed: {error_line(exc)}")
                result.failed.append(core_out.req_id)
                stopped = False
            if stopped:
                result.stopped.append(core_out.req_id)
            out = state.output
            result.outputs.append(out)
            if out.finished:
                del self._states[core_out.req_id]
        return result

    def _decode_token(self, token_id: int) -> str:
        """One token's own text, as logprobs show it (special tokens included)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False) \
                if self._tokenizer is not None else ""
            self._token_texts[token_id] = text
        return text

    def _add_logprobs(self, out: RequestOutput, core_out: EngineCoreOutput) -> None:
        if core_out.prompt_logprobs is not None:
            out.prompt_logprobs = [None, *to_positions(core_out.prompt_logprobs,
                                                       self._decode_token)]
        if out.logprobs is not None and core_out.new_logprobs is not None:
            out.logprobs.extend(to_positions(core_out.new_logprobs, self._decode_token))
            out.cumulative_logprob += sum(core_out.new_logprobs.logprobs)

    def _apply(self, state: _RequestState, core_out: EngineCoreOutput) -> bool:
        """Returns whether a stop string finished the request here."""
        out = state.output
        self._add_logprobs(out, core_out)
        out.token_ids.extend(core_out.new_token_ids)
        metrics = out.metrics
        assert metrics is not None
        metrics.first_scheduled_time = core_out.first_scheduled_time
        metrics.first_token_time = core_out.first_token_time
        metrics.num_preemptions = core_out.num_preemptions
        metrics.num_kv_preemptions = core_out.num_kv_preemptions
        metrics.num_slo_preemptions = core_out.num_slo_preemptions
        metrics.num_cached_tokens = core_out.num_cached_tokens
        metrics.slack_at_admission_s = core_out.slack_at_admission_s
        metrics.num_output_tokens = len(out.token_ids)
        if core_out.finish_reason is not None:
            out.finished, out.finish_reason = True, core_out.finish_reason
            out.stop_reason, out.error = core_out.stop_reason, core_out.error
            metrics.finish_time = core_out.finish_time
        stopped = False
        if state.detokenizer is not None:
            if out.text_offsets is not None:
                out.text_offsets.extend([len(state.detokenizer.output_text)]
                                        * len(core_out.new_token_ids))
            stop = state.detokenizer.update(core_out.new_token_ids)
            if stop is not None and not out.finished:
                out.finished, out.finish_reason, out.stop_reason = True, "stop", stop
                metrics.finish_time = time.monotonic()
                stopped = True
            if out.finished:
                state.detokenizer.flush()
            out.text = state.detokenizer.output_text
        return stopped


def _fail(out: RequestOutput, error: str) -> None:
    out.finished, out.finish_reason, out.stop_reason, out.error = True, "error", None, error
    if out.metrics is not None:
        out.metrics.finish_time = time.monotonic()
