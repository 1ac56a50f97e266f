"""EngineCore.step_observers (engine/runtime/step_timing.py): every step the engine runs reaches
each observer once, with what it scheduled and its times, and the engine never needs a wrapper
around its methods for benchmarks to time it."""

from __future__ import annotations

from engine import LLM, SamplingParams
from engine.runtime.step_timing import StepTiming

# A prompt longer than the step budget: two chunked prefill steps, then decodes.
PROMPT = {"prompt_token_ids": list(range(5, 85))}
MAX_TOKENS = 4


def test_each_step_reaches_every_observer_with_what_it_ran(tiny_model):
    llm = LLM(model=tiny_model("llama"), dtype="float32", device="cpu", max_model_len=128,
              max_num_batched_tokens=64, max_num_seqs=2, startup_calibration=False,
              enable_prefix_caching=False)
    seen: list[StepTiming] = []
    others: list[StepTiming] = []
    calls = 0
    step = llm.engine.step

    def counting_step():
        # The probe: how many steps really ran, counted without the hook.
        nonlocal calls
        calls += 1
        return step()

    llm.engine.step = counting_step
    llm.engine.step_observers += [seen.append, others.append]
    try:
        (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                     ignore_eos=True))
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    assert calls > 0 and len(seen) == calls and others == seen
    ran = [t for t in seen if t.scheduled is not None]
    # 80 prompt tokens in 64-token steps, then one decode per remaining token.
    assert [t.requests for t in ran] == [[(0, 64)], [(64, 16)]] + [
        [(80 + i, 1)] for i in range(MAX_TOKENS - 1)]
    for t in ran:
        assert t.started <= t.ended and 0 < t.execute_seconds <= t.ended - t.started
        assert t.scheduled.requests[0].start_pos == t.requests[0][0]
    assert all(a.ended <= b.started for a, b in zip(seen, seen[1:]))

