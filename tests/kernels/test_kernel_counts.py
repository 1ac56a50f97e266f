"""tests/utils/kernel_counts.py counts what ran, CUDA graph replays included, where a count of
Python calls reads 0 for every step a real graph replays."""

from __future__ import annotations

import dataclasses

from engine import LLM, SamplingParams
from tests.utils.kernel_counts import KernelsRan
from workers.graphs.cuda_graphs import FAKE_GRAPHS_ENV, EagerReplayBackend

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 9)]


def _counts(model_dir: str, ran: KernelsRan, **engine_args
            ) -> tuple[dict[str, int], tuple[int, int] | None]:
    """The ops' counts over the generation, and (whole-graph, piecewise) replays (None: no
    graphs)."""
    llm = LLM(model=model_dir, dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, max_model_len=128, **engine_args)
    try:
        before = ran.snapshot()
        llm.generate(PROMPTS, GREEDY)
        runner = llm.engine.executor.runner
        replays = None if runner.graphs is None else (runner.graphs.replays,
                                                      runner.piecewise.replays)
        return ran.since(before), replays
    finally:
        llm.shutdown()


def _python_calls_after_startup(model_dir: str, **engine_args) -> int:
    """The old way: paged_attention's Python calls, counted from a backend set after the
    capture."""
    llm = LLM(model=model_dir, dtype="float32", device="cpu", block_size=16,
              max_num_batched_tokens=64, max_model_len=128, **engine_args)
    try:
        model = llm.engine.executor.runner.model
        calls = [0]
        inner = model.kernels.paged_attention

        def counted(*args, **kwargs):
            calls[0] += 1
            return inner(*args, **kwargs)

        model.use_kernels(dataclasses.replace(model.kernels, paged_attention=counted))
        llm.generate(PROMPTS, GREEDY)
        return calls[0]
    finally:
        llm.shutdown()


def test_a_replay_that_runs_no_python_still_counts_its_kernels(tiny_model, monkeypatch) -> None:
    """A stand-in replay that, like a real CUDA graph's, calls no Python (its outputs are
    stale, but the schedule, with ignore_eos, does not depend on the tokens): the count equals
    an eager run's, op for op."""
    model_dir = tiny_model("llama")
    monkeypatch.setattr(EagerReplayBackend, "replay", lambda backend, graph: None)
    ran = KernelsRan.install(monkeypatch)
    eager, _ = _counts(model_dir, ran, enforce_eager=True)
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    graphs, replays = _counts(model_dir, ran)
    assert replays is not None and min(replays) > 0  # probe: both kinds of graph replayed
    assert eager["paged_attention"] > 0 and eager["write_kv_cache"] > 0
    assert graphs == eager
    # Paired probe: Python calls miss every decode step the whole graphs replayed.
    assert _python_calls_after_startup(model_dir) < eager["paged_attention"]


def test_the_cpu_stand_in_is_not_counted_twice(tiny_model, monkeypatch) -> None:
    """The stand-in's replay calls the captured Python again: those calls are the replay's,
    counted once from the capture's record."""
    model_dir = tiny_model("llama")
    ran = KernelsRan.install(monkeypatch)
    eager, _ = _counts(model_dir, ran, enforce_eager=True)
    monkeypatch.setenv(FAKE_GRAPHS_ENV, "1")
    graphs, replays = _counts(model_dir, ran)
    assert replays is not None and min(replays) > 0
    assert graphs == eager and eager["paged_attention"] > 0
