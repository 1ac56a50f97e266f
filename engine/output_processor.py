"""Frontend side of a request: turns EngineCore token outputs into text and finished outputs.

Stop strings are checked here, where the text is; a hit finishes the request and the caller tells
EngineCore to drop it (the same split as vLLM v1, so the API server can own detokenization).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import EngineCoreOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class _RequestState:
    output: RequestOutput
    detokenizer: IncrementalDetokenizer | None


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    ttft_slo_ms: float | None = None) -> None:
        detokenizer = None
        if self._tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        output = RequestOutput(request_id=request_id, prompt=prompt,
                               prompt_token_ids=prompt_token_ids,
                               metrics=RequestMetrics(arrival_time=arrival_time,
                                                      ttft_slo_ms=ttft_slo_ms))
        self._states[request_id] = _RequestState(output, detokenizer)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated outputs and the ids finished here by a stop string (to abort in the
        core). Finished requests are forgotten."""
        updated: list[RequestOutput] = []
        stopped: list[str] = []
        for core_out in core_outputs:
            state = self._states.get(core_out.req_id)
            if state is None:  # finished here already (stop string) before the core heard of it
                continue
            out = state.output
            out.token_ids.extend(core_out.new_token_ids)
            metrics = out.metrics
            assert metrics is not None
            metrics.first_scheduled_time = core_out.first_scheduled_time
            metrics.first_token_time = core_out.first_token_time
            metrics.num_preemptions = core_out.num_preemptions
            metrics.num_cached_tokens = core_out.num_cached_tokens
            if core_out.finish_reason is not None:
                out.finished, out.finish_reason = True, core_out.finish_reason
                out.stop_reason = core_out.stop_reason
                metrics.finish_time = core_out.finish_time
            if state.detokenizer is not None:
                stop = state.detokenizer.update(core_out.new_token_ids)
                if stop is not None and not out.finished:
                    out.finished, out.finish_reason, out.stop_reason = True, "stop", stop
                    metrics.finish_time = time.monotonic()
                    stopped.append(core_out.req_id)
                if out.finished:
                    state.detokenizer.flush()
                out.text = state.detokenizer.output_text
            updated.append(out)
            if out.finished:
                del self._states[core_out.req_id]
        return updated, stopped
