"""Offline inference: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, TypedDict, Union

from tqdm import tqdm

from engine.config import build_engine_config
from engine.processing.input_processor import ChatMessages, InputProcessor, check_fits_context
from engine.runtime.engine_core import EngineCore
from engine.processing.output_processor import OutputProcessor
from engine.outputs import RequestOutput, best_samples
from engine.core.request import Request, RequestStatus
from engine.sampling_params import SamplingParams


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = Union[str, TokensPrompt]


class LLM:
    """A model served in this process. Arguments mirror vLLM's engine arguments."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """engine_args: the keyword arguments of `engine.config.build_engine_config`, e.g.
        ``device`` ("auto", the default: the GPU when torch sees one, else the CPU; or "cpu",
        "cuda"), ``tokenizer`` (a tokenizer folder other than the model's) and ``chat_template``
        (a Jinja template, or a file holding one, for `chat`)."""
        from engine.entrypoints.default_model import model_path_or_default
        from engine.entrypoints.deprecated_args import rename_deprecated_kwargs

        model = model_path_or_default(model)
        config = build_engine_config(model, **rename_deprecated_kwargs(engine_args))
        self.engine = EngineCore(config)
        self.inputs = InputProcessor.for_model(config.model)
        self.tokenizer = self.inputs.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 priority: Sequence[int] | None = None,
                 ttft_slo_ms: float | Sequence[float | None] | None = None,
                 tpot_slo_ms: float | Sequence[float | None] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs all prompts to completion; outputs come back in the order of the prompts.
        `ttft_slo_ms`: time-to-first-token objective(s), counted from this call; `tpot_slo_ms`:
        time-per-output-token objective(s).

        Bad input (a prompt, a sampling parameter, a ``max_tokens`` that cannot fit in the
        context beside its prompt, named in vLLM's words) raises ValueError before anything
        runs; with ``sampling_params`` left out, the default 16 tokens stop at the context. A
        request that fails while it runs (its sampling, its logits, its detokenization) does not
        raise: its output comes back with ``finish_reason == "error"`` and the reason in
        ``output.error`` (the traceback is logged), and the other prompts finish normally. Only a
        failure of the engine itself (a worker died) raises, as EngineStepError."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        encoded = [self._encode(p) for p in prompts]
        return self._run(encoded, sampling_params, priority, use_tqdm, ttft_slo_ms, tpot_slo_ms)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Applies the model's chat template (with the generation prompt) to each conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [(None, self.apply_chat_template(c)) for c in conversations]
        return self._run(encoded, sampling_params, None, use_tqdm, messages=True)

    def apply_chat_template(self, messages: ChatMessages) -> list[int]:
        return self.inputs.apply_chat_template(messages)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return None, list(prompt["prompt_token_ids"])
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        return prompt, self.inputs.encode(prompt)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             priority: Sequence[int] | None, use_tqdm: bool,
             ttft_slo_ms: float | Sequence[float | None] | None = None,
             tpot_slo_ms: float | Sequence[float | None] | None = None, *,
             messages: bool = False) -> list[RequestOutput]:
        """``messages``: the prompts came from chat messages (the errors say so)."""
        params = _per_prompt(sampling_params, len(encoded), "sampling_params", SamplingParams())
        priorities = _per_prompt(priority, len(encoded), "priority", 0)
        slos = _per_prompt(ttft_slo_ms, len(encoded), "ttft_slo_ms", None)
        tpots = _per_prompt(tpot_slo_ms, len(encoded), "tpot_slo_ms", None)
        for name, values in (("ttft_slo_ms", slos), ("tpot_slo_ms", tpots)):
            for slo in values:
                if slo is not None and not 0 < slo < float("inf"):
                    raise ValueError(f"{name} must be a positive number of milliseconds, "
                                     f"got {slo}")
        # One request per sample: n > 1 is n requests, the later ones waiting on the first's
        # prefill so that they share its KV (engine.core.sibling_gate).
        groups: list[list[Request]] = []
        for (_, ids), sp, prio, slo, tpot in zip(encoded, params, priorities, slos, tpots):
            group: list[Request] = []
            for index in range(sp.num_samples):
                leader = group[0].request_id if group else None
                child = sp.child(index) if sp.num_samples > 1 else sp
                group.append(self._make_request(ids, child, prio, slo, tpot,
                                                prefill_after=leader))
            groups.append(group)
        requests = [request for group in groups for request in group]
        prompts = [prompt for (prompt, _), group in zip(encoded, groups) for _ in group]
        # Validate every request before any is queued: one bad prompt must not strand the rest.
        for request in requests:
            self.engine.validate_request(request)
        if sampling_params is not None:  # left out: the default's 16 tokens, up to the context
            for (_, ids), sp in zip(encoded, params):
                check_fits_context(len(ids), sp.max_tokens, self.engine.max_model_len,
                                   messages=messages)
        processor = OutputProcessor(self.tokenizer)
        for prompt, request in zip(prompts, requests):
            processor.add_request(request.request_id, prompt, request.prompt_token_ids,
                                  request.sampling_params, request.arrival_time,
                                  request.ttft_slo_ms, request.tpot_slo_ms)
            self.engine.add_request(request)
        finals: dict[str, RequestOutput] = {}
        # A TTFT deadline stays live until the request's first non-empty text (see Request).
        awaiting_text = {r.request_id for r in requests if r.reports_first_output}
        progress = tqdm(total=len(requests), desc="Generating", disable=not use_tqdm)
        try:
            while processor.num_unfinished:
                processed = processor.process(self.engine.step())
                for out in processed.outputs:
                    if out.text and out.request_id in awaiting_text:
                        awaiting_text.discard(out.request_id)
                        self.engine.note_first_output(out.request_id, time.monotonic())
                if processed.stopped:
                    self.engine.abort_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
                if processed.failed:  # frees their KV in the core
                    self.engine.abort_requests(processed.failed, RequestStatus.FINISHED_ERROR)
                for out in processed.outputs:
                    if out.finished:
                        finals[out.request_id] = out
                        progress.update()
        except BaseException:
            self.engine.abort_requests([r.request_id for r in requests])
            raise
        finally:
            progress.close()
        return [_gather([finals[r.request_id] for r in group], sp)
                for group, sp in zip(groups, params)]

    def _make_request(self, ids: list[int], params: SamplingParams, priority: int,
                      ttft_slo_ms: float | None = None,
                      tpot_slo_ms: float | None = None,
                      prefill_after: str | None = None) -> Request:
        params, eos = self.inputs.with_eos(params)
        return Request(request_id=str(next(self._ids)), prompt_token_ids=ids,
                       sampling_params=params, eos_token_id=eos, arrival_time=time.monotonic(),
                       priority=priority, ttft_slo_ms=ttft_slo_ms, tpot_slo_ms=tpot_slo_ms,
                       prefill_after=prefill_after,
                       reports_first_output=ttft_slo_ms is not None)

    def shutdown(self) -> None:
        self.engine.shutdown()


def _gather(samples: list[RequestOutput], params: SamplingParams) -> RequestOutput:
    """One prompt's outputs: the first (with best_of: the best) sample, carrying all those
    returned when there are several."""
    if params.ranks_samples:
        samples = best_samples(samples, params.n, keep_logprobs=params.logprobs is not None)
    first = samples[0]
    if len(samples) > 1:
        first.samples = samples
    return first


def _per_prompt(value, count: int, name: str, default):
    if value is None:
        return [default] * count
    if isinstance(value, (SamplingParams, int, float)):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise ValueError(f"{name}: got {len(value)} values for {count} prompts")
    return value
