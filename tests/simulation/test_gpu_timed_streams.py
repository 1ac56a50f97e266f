"""An urgent turn's whole stream at GPU time scales, in the GPU-timed simulation:
a 24k-token document prefills (~1.2 s of simulated H100 time), and a 64-token turn with a
150 ms TTFT objective arrives during it. The turn's first token shows nothing (a special
token, say): the consumer (as the API server does) reports its first *visible* output, the
second token. The objective is met only if that one is on time, and the turn then streams
without stalling behind the rest of the step it interrupted.

Before: the deadline ended with the sampled (invisible) token, the victim's whole suspended
chunk resumed beside the turn's next token, and the first visible token came at ~920 ms."""

from __future__ import annotations

import random
import threading
import time

import pytest

from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams

# Alone (the README's serial run): the simulated steps are real sleeps, checked against
# deadlines.
pytestmark = pytest.mark.serial

PROFILE = "h100-llama-3.1-8b"
SLO_MS = 150.0
TURN_TOKENS = 16


def _request(req_id: str, tokens: int, slo_ms: float, max_tokens: int, seed: int) -> Request:
    rng = random.Random(seed)
    return Request(request_id=req_id,
                   prompt_token_ids=[rng.randrange(5, 300) for _ in range(tokens)],
                   sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True),
                   ttft_slo_ms=slo_ms, reports_first_output=True)


@pytest.mark.parametrize("budget", [2048, 40_000], ids=["chunked", "unchunked"])
def test_an_urgent_turn_whose_first_token_is_silent_streams_on_time(sim_model, budget):
    engine = EngineCore(build_engine_config(sim_model, simulate=PROFILE,
                                            max_num_batched_tokens=budget, max_model_len=40_000,
                                            enable_prefix_caching=False))
    try:
        document = _request("doc", 24_000, 20_000.0, 4, seed=1)
        turn = _request("turn", 64, SLO_MS, TURN_TOKENS, seed=2)
        start = time.monotonic()
        engine.submit_request(document)

        def arrive() -> None:
            time.sleep(max(0.0, start + 0.35 - time.monotonic()))
            turn.arrival_time = time.monotonic()
            engine.submit_request(turn)

        thread = threading.Thread(target=arrive, daemon=True)
        thread.start()
        token_times: list[float] = []  # the turn's tokens as the consumer receives them
        while thread.is_alive() or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests():
                time.sleep(0.0005)
                continue
            for out in engine.step():
                if out.req_id == "turn" and out.new_token_ids:
                    token_times.append(time.monotonic())
                    if len(token_times) == 2:  # the first visible output
                        engine.note_first_output("turn", token_times[-1])
        decisions = [d for d in engine.slo_preemption.monitor.decisions
                     if d.decision.waiter_id == "turn"]
        decode_step = engine.model.profile.step_seconds(1, 0, 64 + TURN_TOKENS)
    finally:
        engine.shutdown()
    # Probes: the document's step was stopped for the turn, whose first token came out
    # before its first visible one.
    assert decisions and document.num_slo_preemptions >= 1
    assert len(token_times) == TURN_TOKENS and document.finish_time is not None
    visible_ms = 1000 * (token_times[1] - turn.arrival_time)
    assert visible_ms <= SLO_MS, (visible_ms, 1000 * (token_times[0] - turn.arrival_time))
    gaps = sorted(b - a for a, b in zip(token_times, token_times[1:]))
    # Two decode-only steps (what the interactive gap allows), and the engine loop's own time.
    assert gaps[-1] <= 2 * decode_step + 0.02, [round(1000 * (b - a)) for a, b in zip(token_times, token_times[1:])]
