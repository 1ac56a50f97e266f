"""The GPU-timed simulation (engine/simulation): step-time profiles, the model-free executor
(on a fake clock, so its timing is checked exactly), and the real engine over it."""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import build_engine_config
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput, StepStatus
from engine.runtime.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from engine.simulation import StepTimeProfile, load_profile, shipped_profiles
from engine.executor.simulated import SimulatedExecutor
from monitor.step_time_model import StepTimeModel
from monitor.slo_preempt_signal import SLOPreemptSignal
from workers.preemption.slo_preempt_vote import SLOPreemptVote
from tests.utils.device_clock import FakeClock

H100 = "h100-llama-3.1-8b"


# ---- profiles -------------------------------------------------------------------------------

def _prefill(profile: StepTimeProfile, tokens: int, prefix: int = 0) -> float:
    return profile.step_seconds(tokens, tokens * (2 * prefix + tokens), 0)


def test_the_h100_profile_holds_the_figures_measured_on_the_gpu():
    """The figures measured on an H100 (Llama-3.1-8B shape, bf16): ~30k tok/s at 4096-token prompts,
    a 24k-token step ~1.2 s, a 2048-token chunk over a long prefix 140-170 ms, decode steps
    ~30 ms at batch 1-64."""
    assert H100 in shipped_profiles()
    p = load_profile(H100)
    assert p.num_layers == 32 and p.model_shape == "llama-3.1-8b"
    assert 27_000 <= 4096 / _prefill(p, 4096) <= 33_000
    assert 1.1 <= _prefill(p, 24_000) <= 1.3
    assert 0.14 <= _prefill(p, 2048, prefix=26_000) <= 0.17
    for batch in (1, 64):
        assert p.step_seconds(batch, 0, batch * 4096) == pytest.approx(0.030, rel=0.05)


def test_a_profile_from_a_calibration_file(tmp_path):
    line = StepTimeModel(seconds_per_token=2e-4, intercept_s=0.01, seconds_per_token_sq=1e-8,
                         seconds_per_decode_context=3e-6)
    line.save(tmp_path / "cal.json")
    p = load_profile(str(tmp_path / "cal.json"), num_layers=30)
    assert p.num_layers == 30 and p.floor_s == 0.0
    for tokens, attention, context in [(100, 10_000, 0), (1, 0, 500), (512, 512 ** 2, 2000)]:
        assert p.step_seconds(tokens, attention, context) == pytest.approx(
            line.predict_step(tokens, attention, context))


@pytest.mark.parametrize("content, expected", [
    (None, "neither a shipped profile"),
    ("{", "is not JSON"),
    ('{"name": "x", "num_layers": 4, "seconds_per_token": 1e-4, "warp": 9}', "warp"),
    ('{"name": "x", "num_layers": 4, "seconds_per_token": -1}', "seconds_per_token must be"),
    ('{"name": "x", "num_layers": 0, "seconds_per_token": 1e-4}', "num_layers must be"),
    ('{"seconds_per_token": 1e-4, "intercept_s": 0.01}', "needs the model's number of layers"),
])
def test_a_bad_profile_is_an_error_naming_what_is_wrong(tmp_path, content, expected):
    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=expected):
        load_profile(str(path))


def test_a_model_of_another_shape_is_refused(tiny_model):
    with pytest.raises(ValueError, match="times a 32-layer model"):
        EngineCore(build_engine_config(tiny_model("llama"), simulate=H100))


# ---- the executor, on a fake clock ------------------------------------------------------------

PROFILE = StepTimeProfile(name="test", num_layers=4, seconds_per_token=1e-3, intercept_s=0.0,
                          floor_s=0.002, unwind_s=0.0005)


def _request(req_id: str, n: int, start: int = 0, sample: bool = True,
             resume: bool = False) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=list(range(5, 5 + n)), start_pos=start,
                            block_ids=[0], sample=sample, resume=resume,
                            sampling_params=SamplingParams(temperature=0))


class RecordingVote(SLOPreemptVote):
    """The real vote, recording each layer it saw and the clock when it saw it; `stop_before`
    makes the monitor target the running step once that layer is reached."""

    def __init__(self, signal: SLOPreemptSignal, clock: FakeClock) -> None:
        super().__init__(signal, PROFILE.num_layers, stubborn_fraction=1.0)
        self.clock, self.seen = clock, []
        self.stop_before: int | None = None

    def __call__(self, layer: int) -> None:
        self.seen.append((layer, self.clock.now))
        if layer == self.stop_before:
            self.signal.publish(self.step_id, "victim", "waiter", self.clock.now)
        super().__call__(layer)


@pytest.fixture
def signal():
    s = SLOPreemptSignal.create()
    yield s
    s.close()


def _executor(signal, clock):
    vote = RecordingVote(signal, clock)
    return SimulatedExecutor(PROFILE, num_kv_blocks=8, vocab_size=50, avoid_token_ids=[0],
                             vote=vote, sleep=clock.sleep, clock=clock), vote


def test_a_step_takes_the_profiles_time_and_votes_before_every_layer(signal):
    clock = FakeClock()
    executor, vote = _executor(signal, clock)
    out = executor.execute_model(SchedulerOutput(step_id=1, requests=[_request("a", 100)],
                                                 preemptible=True))
    assert out.status is StepStatus.OK and out.execute_seconds == pytest.approx(0.1)
    assert [layer for layer, _ in vote.seen] == [0, 1, 2, 3]
    assert [t for _, t in vote.seen] == pytest.approx([0.0, 0.025, 0.05, 0.075])
    assert signal.layers_done(1) == 3  # progress the monitor reads
    # A step that does not vote sleeps its time at once; the floor holds for a small one.
    out = executor.execute_model(SchedulerOutput(step_id=2, requests=[_request("b", 1)]))
    assert out.execute_seconds == pytest.approx(PROFILE.floor_s) and len(vote.seen) == 4


def test_an_unwound_step_suspends_its_chunks_and_they_resume_at_their_layer(signal):
    clock = FakeClock()
    executor, vote = _executor(signal, clock)

    def run(step_id: int, *requests: ScheduledRequest, stop_before: int | None = None):
        vote.stop_before, clock.now = stop_before, 0.0
        return executor.execute_model(SchedulerOutput(step_id=step_id, requests=list(requests),
                                                      preemptible=True, suspend_on_unwind=True))

    out = run(1, _request("a", 100), _request("d", 1, start=50), stop_before=0)
    assert out.status is StepStatus.SLO_PREEMPTED and out.slo_preempted_layer == 0
    assert out.suspended_req_ids == []  # stopped before a layer finished: nothing to keep
    out = run(2, _request("a", 100), _request("d", 1, start=50), stop_before=2)
    assert out.status is StepStatus.SLO_PREEMPTED and out.slo_preempted_layer == 2
    assert out.suspended_req_ids == ["a"] and executor.suspended == {"a": [(0, 100, 2)]}
    # Two layers of 101 tokens, then the unwind.
    assert out.execute_seconds == pytest.approx(2 * 0.101 / 4 + PROFILE.unwind_s)
    # Resumed beside a fresh chunk: layers 0-1 hold the fresh 40 tokens only, 2-3 all 140.
    out = run(3, _request("b", 40), _request("a", 100, resume=True))
    assert out.status is StepStatus.OK and executor.suspended == {}
    assert out.execute_seconds == pytest.approx(2 * 0.040 / 4 + 2 * 0.140 / 4)
    assert out.resumed_layers == {"a": 2}  # what the TTFT predictor counts it by
    with pytest.raises(ValueError, match="resumes"):
        run(4, _request("a", 100, resume=True))


def test_sampled_tokens_are_deterministic_and_never_eos(signal):
    clock = FakeClock()
    executor, _ = _executor(signal, clock)
    tokens = set()
    for i in range(200):
        out = executor.execute_model(SchedulerOutput(step_id=i + 1,
                                                     requests=[_request("a", 1, start=i)]))
        tokens.add(out.sampled_token_ids["a"])
    assert 0 not in tokens and len(tokens) > 10
    again = executor.execute_model(SchedulerOutput(step_id=500, requests=[_request("a", 1, 7)]))
    first = executor.execute_model(SchedulerOutput(step_id=501, requests=[_request("a", 1, 7)]))
    assert again.sampled_token_ids == first.sampled_token_ids


# ---- over HTTP ---------------------------------------------------------------------------------

def test_serve_simulate_stops_a_long_prefill_for_an_urgent_request(sim_model, tmp_path):
    """`sloserve serve MODEL --simulate h100-llama-3.1-8b`: a 24k-token prompt prefills in one
    step (the budget holds it unchunked) for ~1.2 s of simulated H100 time; a 64-token request
    with a 150 ms SLO arriving during that step is answered first, after the step is unwound
    (the slo preemption counter is the probe)."""
    import httpx

    from tests.utils.server_helpers import ServerProcess, collect_stream, sample, scrape, sse_data

    server = ServerProcess(sim_model, tmp_path / "server.log", "--simulate", H100,
                           "--max-model-len", "32768", "--max-num-batched-tokens", "32768")
    try:
        results: dict[str, dict] = {}
        long_accepted = threading.Event()

        def complete(name: str, prompt: list[int], slo_ms: float) -> None:
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True, "ttft_slo_ms": slo_ms}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                              timeout=60.0) as response:
                assert response.status_code == 200, response.read()
                if name == "long":
                    long_accepted.set()
                results[name] = collect_stream(sse_data(response.iter_lines()))

        long = threading.Thread(target=complete, args=("long", [7] * 24_000, 60_000.0))
        long.start()
        # A stream's headers come once its request is on its way to the engine core, which is
        # idle and starts the one long step at once. (Not /debug/stats: the core reports its
        # gauges after each step, so num_running turns 1 only once this step has ended.)
        assert long_accepted.wait(30.0), server.log()
        time.sleep(0.2)  # a few of its 32 layers
        complete("urgent", [9] * 64, 150.0)
        long.join()
        assert results["urgent"]["done"] and results["long"]["done"], results
        assert results["urgent"]["usage"] is None or results["urgent"]["usage"][
            "completion_tokens"] == 8
        urgent, long_ = results["urgent"]["metrics"], results["long"]["metrics"]
        assert urgent["ttft_ms"] < long_["ttft_ms"]
        assert long_["num_slo_preemptions"] == 1 and urgent["num_slo_preemptions"] == 0
        _, samples = scrape(server.url)
        assert sample(samples, "sloserve:num_slo_preemptions_total") == 1
    finally:
        server.assert_clean_stop()
