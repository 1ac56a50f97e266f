"""Decodes scheduled ahead (async scheduling) on the in-process model runner: the step is queued
before the previous one is read back, and its input token is taken on the device from the
previous step's samples (workers.model_runner, ``last_token_pending``).

- The engine with async scheduling generates exactly the tokens the serial engine does (greedy,
  seeded random, a stop token seen a step late), eager and through the CPU stand-in for CUDA
  graphs (whose padding rows repeat a decode scheduled ahead); a probe checks that decodes
  really were scheduled ahead in the async run and never in the serial one.
- A decode scheduled ahead of a token the step before did not sample fails its step with an
  ERROR naming the request (the executor's structured status, never an exception).
- The sampler's two halves (``launch`` then ``finish``) give what a call gives.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.scheduler_output import (PENDING_TOKEN, ScheduledRequest, SchedulerOutput,
                                          StepStatus)
from engine.executor.base import Overlapping
from engine.executor.in_process import InProcessExecutor
from engine.runtime.step_timing import StepTiming
from tests.utils.runner_configs import runner_config
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV
from workers.layers.cpu_prepack import PREPACK_ENV
from workers.sample.logits_processors import TokenHistory
from workers.sample.sampler import Sampler
from workers.step_buffers import StepLimits

ENGINE_ARGS = dict(dtype="float32", device="cpu", block_size=16, max_model_len=128,
                   max_num_batched_tokens=64, max_num_seqs=8, startup_calibration=False)
# Prompt lengths: the longest takes two prefill steps (the budget is 64 tokens).
LENGTHS = [5, 40, 17, 70, 23]
STOP_AT = 4  # the stop request ends at the token its unstopped run sampled here


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def _params(stop_token: int | None = None) -> list[SamplingParams]:
    """Greedy and seeded random rows of different lengths; the last one stops at
    ``stop_token`` (None: it runs to its length, to find the token)."""
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=20,
                       stop_token_ids=[stop_token] if stop_token is not None else [],
                       ignore_eos=stop_token is None),
    ]


def _stop_token(tokens: list[int]) -> int:
    """A token at STOP_AT or later that does not occur before it."""
    for i in range(STOP_AT, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i]
    raise AssertionError(f"no fresh token to stop at in {tokens}")


def _count_pending(llm: LLM) -> list[int]:
    """Per step the engine ran, the decodes it scheduled ahead (last_token_pending)."""
    counts: list[int] = []

    def observe(timing: StepTiming) -> None:
        if timing.scheduled is not None:
            counts.append(sum(r.last_token_pending for r in timing.scheduled.requests))

    llm.engine.step_observers.append(observe)
    return counts


def _run(model: str, async_scheduling: bool) -> tuple[list[list[int]], list[str], list[int],
                                                       int]:
    """The tokens and finish reasons of the mixed batch (two rounds: the stop request learns
    its stop token from the first), the decodes scheduled ahead per step, and the graph
    replays."""
    llm = LLM(model=model, async_scheduling=async_scheduling, **ENGINE_ARGS)
    try:
        prompts = [{"prompt_token_ids": p} for p in _prompts(llm.engine.vocab_size)]
        unstopped = llm.generate(prompts, _params())
        pending = _count_pending(llm)
        outputs = llm.generate(prompts, _params(_stop_token(unstopped[-1].token_ids)))
        runner = llm.engine.executor.runner
        replays = runner.graphs.replays if runner.graphs is not None else 0
        llm.engine.scheduler.check_invariants()
        assert (llm.engine.scheduler.kv_cache_manager.num_free_blocks
                == llm.engine.model.num_blocks)
        return ([o.token_ids for o in unstopped + outputs],
                [o.finish_reason for o in unstopped + outputs], pending, replays)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fake-graphs"])
def test_async_scheduling_generates_the_serial_tokens(tiny_model, monkeypatch,
                                                      graphs: bool) -> None:
    if graphs:
        monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
        monkeypatch.setenv(PREPACK_ENV, "0")
    # On a CPU the engine keeps its serial loop (a launch computes the step): overlap as on a
    # GPU, so that the data path a GPU takes runs here.
    monkeypatch.setattr(InProcessExecutor, "overlaps_host", True)
    model = tiny_model("llama")
    serial_tokens, serial_reasons, serial_pending, serial_replays = _run(model, False)
    async_tokens, async_reasons, async_pending, async_replays = _run(model, True)
    assert async_tokens == serial_tokens
    assert async_reasons == serial_reasons
    # Probes: the stop request really stopped early on its stop token, the async run really
    # scheduled decodes ahead (the serial one never), and graphs replayed where they were on.
    unstopped, stopped = serial_tokens[len(LENGTHS) - 1], serial_tokens[-1]
    assert serial_reasons[-1] == "stop" and serial_reasons[len(LENGTHS) - 1] == "length"
    assert STOP_AT < len(stopped) < len(unstopped) and stopped == unstopped[:len(stopped)]
    assert sum(serial_pending) == 0
    assert sum(async_pending) > 0
    assert (serial_replays > 0 and async_replays > 0) if graphs else async_replays == 0


def test_on_a_cpu_async_scheduling_keeps_the_serial_loop(tiny_model, caplog) -> None:
    """A CPU computes a step as it is launched: scheduling ahead would only hold each token
    back a step, so the engine says so and runs the serial loop."""
    llm = LLM(model=tiny_model("llama"), async_scheduling=True, **ENGINE_ARGS)
    try:
        pending = _count_pending(llm)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    finally:
        llm.shutdown()
    assert "async scheduling is off" in caplog.text
    assert len(out[0].token_ids) == 6 and sum(pending) == 0


def _prefill(req_id: str, first_block: int) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=list(range(3, 13)), start_pos=0,
                            block_ids=[first_block], sample=True,
                            sampling_params=SamplingParams(temperature=0))


def _decode(req_id: str, token: int, first_block: int) -> ScheduledRequest:
    """The decode after _prefill's prompt; PENDING_TOKEN: scheduled ahead of its token."""
    return ScheduledRequest(req_id=req_id, token_ids=[token], start_pos=10,
                            block_ids=[first_block], sample=True,
                            sampling_params=SamplingParams(temperature=0),
                            last_token_pending=token == PENDING_TOKEN)


def test_a_decode_ahead_takes_the_token_in_flight_or_fails_its_step(tiny_model) -> None:
    executor = InProcessExecutor(runner_config(
        tiny_model("llama"), num_blocks=16, limits=StepLimits(64, 4, 64)))
    try:
        assert isinstance(executor, Overlapping) and not executor.overlaps_host  # a CPU
        first = executor.submit_model(SchedulerOutput(step_id=1, requests=[_prefill("a", 0)]))
        # Queued before step 1 is read: "a" is fed by the token step 1 sampled for it.
        ahead = executor.submit_model(SchedulerOutput(step_id=2, requests=[
            _decode("a", PENDING_TOKEN, 0)]))
        sampled = first.result()
        assert sampled.status is StepStatus.OK
        got = ahead.result()
        assert got.status is StepStatus.OK, got.error
        # The same request run serially, with its token given, in blocks of its own.
        executor.execute_model(SchedulerOutput(step_id=3, requests=[_prefill("s", 1)]))
        want = executor.execute_model(SchedulerOutput(step_id=4, requests=[
            _decode("s", sampled.sampled_token_ids["a"], 1)]))
        assert got.sampled_token_ids["a"] == want.sampled_token_ids["s"]
        # "b" was not sampled by the step before (step 4 sampled "s" only).
        out = executor.submit_model(SchedulerOutput(step_id=5, requests=[
            _decode("b", PENDING_TOKEN, 2)])).result()
        assert out.status is StepStatus.ERROR and out.step_id == 5
        assert "ValueError: request b was scheduled ahead" in (out.error or "")
    finally:
        executor.shutdown()


def test_launch_then_finish_equals_a_call() -> None:
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=1.0, seed=9, top_k=20, logprobs=3),
              SamplingParams(temperature=0, logprobs=1),
              SamplingParams(temperature=0.8, top_p=0.8, seed=2, logprobs=0)]
    logits = torch.randn(len(params), 300, generator=torch.Generator().manual_seed(1)) * 3
    indices = [0, 5, 2, 7, 1]
    histories = [TokenHistory() for _ in params]
    called = Sampler(seed=0)(logits, params, indices, histories)
    pending = Sampler(seed=0).launch(logits, params, indices, histories)
    # The device half leaves the ids on the device, one per row.
    assert pending.tokens.shape == (len(params),) and pending.tokens.dtype == torch.long
    finished = pending.finish()
    assert finished == called
    assert pending.tokens.tolist() == called.token_ids
    assert set(finished.logprobs) == {2, 3, 4}  # probe: the logprob rows were read back
