"""The slo policy keeps decodes within their TPOT objective: a long prefill arrives
while four requests decode with a 300 ms objective; its prefill is cut into chunks whose predicted
time fits the next-token deadlines, so no step the decoders wait on is predicted to exceed 300 ms.
Probe: under fcfs the same prefill runs as one step and the gap it causes misses the objective.
The chunks are checked by their predicted time, not by the wall clock: the test hook's sleeps make
the steps take about that long, but on a loaded 2-core machine any gap can stretch (and a gap that
exceeds the objective under fcfs only exceeds it more).

Step times are made proportional to tokens by the test hook that sleeps per token in every layer
(0.4 ms x 3 layers = 1.2 ms per token), and the TTFT line given to the engine says the same."""

from __future__ import annotations

import time


from engine.config import build_engine_config
from engine.core.request import Request
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from monitor.step_time_model import StepTimeModel
from workers.preemption.layer_delay import LAYER_DELAY_ENV

TPOT_SLO_MS = 300.0
LONG_PROMPT = 1000


def _gaps_and_long_chunks(model: str, policy: str, ttft_model: str
                          ) -> tuple[list[float], list[int], list[int]]:
    engine = EngineCore(build_engine_config(
        model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=2048,
        scheduling_policy=policy, ttft_model=ttft_model, slo_preemption=False))
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        decoders = [Request(request_id=f"d{i}", prompt_token_ids=[7 + i] * 8,
                            sampling_params=params, arrival_time=time.monotonic(),
                            tpot_slo_ms=TPOT_SLO_MS) for i in range(4)]
        for request in decoders:
            engine.add_request(request)
        token_times: dict[str, list[float]] = {r.request_id: [] for r in decoders}
        long_chunks: list[int] = []
        # How many decoders ran in each chunk's step: once they are done (on a loaded machine
        # the online refit can slow the prefill past their last token) a chunk has no
        # objective to fit.
        decodes_beside: list[int] = []
        long = Request(request_id="long", prompt_token_ids=[3] * LONG_PROMPT,
                       sampling_params=SamplingParams(temperature=0, max_tokens=2,
                                                      ignore_eos=True),
                       arrival_time=time.monotonic())
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 500
            if steps == 4:  # the decoders are decoding: the long prompt arrives
                engine.add_request(long)
            before = long.num_computed_tokens
            outputs = engine.step()
            now = time.monotonic()
            decoded = [out.req_id for out in outputs
                       if out.req_id in token_times and out.new_token_ids]
            if long.num_computed_tokens > before and long.first_token_time is None or \
                    long.num_computed_tokens - before > 1:
                long_chunks.append(long.num_computed_tokens - before)
                decodes_beside.append(len(decoded))
            for req_id in decoded:
                token_times[req_id].append(now)
        gaps = [b - a for times in token_times.values() for a, b in zip(times, times[1:])]
        return gaps, long_chunks, decodes_beside
    finally:
        engine.shutdown()


def test_decodes_stay_within_their_tpot_while_a_long_prefill_is_chunked(tiny_model, tmp_path,
                                                                        monkeypatch):
    model = tiny_model("llama")
    monkeypatch.setenv(LAYER_DELAY_ENV, "400")
    line = tmp_path / "ttft.json"
    predictor = StepTimeModel(seconds_per_token=1.2e-3, intercept_s=0.002)
    predictor.save(line)
    gaps, chunks, decodes_beside = _gaps_and_long_chunks(model, "slo", str(line))
    assert sum(chunks) == LONG_PROMPT and len(chunks) > 3  # probe: the cap chunked it
    assert max(c for c, decodes in zip(chunks, decodes_beside) if decodes) < LONG_PROMPT / 2
    # Each chunk that shares its step with decodes fits their objective, the decodes included.
    predicted_ms = [1000 * predictor.predict(chunk + decodes)
                    for chunk, decodes in zip(chunks, decodes_beside) if decodes]
    assert predicted_ms and max(predicted_ms) <= TPOT_SLO_MS, (chunks, decodes_beside,
                                                              predicted_ms)
    assert len(gaps) == 4 * 29  # probe: every decoder's 30 tokens were timed
    fcfs_gaps, fcfs_chunks, _ = _gaps_and_long_chunks(model, "fcfs", str(line))
    assert fcfs_chunks == [LONG_PROMPT]  # probe: without the cap it is one step ...
    assert max(fcfs_gaps) * 1000 > TPOT_SLO_MS  # ... and that step's gap misses the objective
