"""`--on-doomed reject` on one server (engine.serving.doomed), on the GPU-timed simulation of an
H100 serving Llama-3.1-8B: a request whose TTFT objective cannot be met even if it were served
ahead of everything is refused at once with 429, `predicted_ttft_ms` and its objective; a
feasible one is served; a request already admitted (a long prompt streaming meanwhile) runs to
its end; both rejection counters count the refusal under the reason `doomed`. The probe that the
429 is the flag's doing: the same request under `serve` is answered, and late."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest

from engine.load.load_report import QueuedRequest, ReplicaLoad
from engine.load.prefix_hashes import prompt_prefix_hashes
from engine.serving.api_server import ServerSettings
from engine.serving.doomed import DOOMED, DoomedCheck, RequestDoomed
from monitor.step_time_model import StepTimeModel
from tests.utils.inprocess_server import app_client

H100 = "h100-llama-3.1-8b"
LONG_PROMPT = [7 + i % 900 for i in range(6000)]
SHORT_PROMPT = [11 + i for i in range(24)]


def _counter(text: str, name: str, reason: str) -> float:
    match = re.search(rf'^{re.escape(name)}{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$', text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _body(prompt: list[int], slo_ms: float, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "ignore_eos": True,
            "ttft_slo_ms": slo_ms, "stream": stream}


def test_a_doomed_request_is_refused_a_feasible_one_served_and_the_admitted_one_finishes(
        sim_model):
    settings = ServerSettings(served_model_name="tiny", on_doomed="reject")

    async def run():
        async with app_client(sim_model, settings, simulate=H100, max_model_len=8192,
                              num_kv_blocks=2048) as (http, client):
            admitted = asyncio.create_task(
                http.post("/v1/completions", json=_body(LONG_PROMPT, 60_000, stream=True)))
            for _ in range(500):  # until the engine holds it
                if (await client.load_report()).num_requests:
                    break
                await asyncio.sleep(0.005)
            doomed = await http.post("/v1/completions", json=_body(SHORT_PROMPT, 1))
            feasible = await http.post("/v1/completions", json=_body(SHORT_PROMPT, 60_000))
            metrics = (await http.get("/metrics")).text
            settings.on_doomed = "serve"  # the probe: the same request, served when asked to
            late = await http.post("/v1/completions", json=_body(SHORT_PROMPT, 1))
            return doomed, feasible, await admitted, late, metrics

    doomed, feasible, admitted, late, metrics = asyncio.run(run())
    assert doomed.status_code == 429, doomed.text
    error = doomed.json()["error"]
    assert error["type"] == "RateLimitError" and error["code"] == 429
    assert error["ttft_slo_ms"] == 1 and error["predicted_ttft_ms"] > 1
    assert "--on-doomed reject" in error["message"]
    assert int(doomed.headers["retry-after"]) >= 1
    assert doomed.headers["x-sloserve-rejected"] == "doomed"
    assert feasible.status_code == 200 and feasible.json()["usage"]["completion_tokens"] == 8
    # Admitted before the refusal, it streamed to its end.
    assert admitted.status_code == 200
    events = [line[6:] for line in admitted.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"]]
    assert finishes[-1] == "length"  # all of its max_tokens
    for name in ("sloserve:num_requests_rejected_total", "vllm:admission_rejections_total"):
        assert _counter(metrics, name, DOOMED) == 1, name
    assert late.status_code == 200
    assert late.json()["metrics"]["ttft_ms"] > 1  # it really was late


MODEL = StepTimeModel(seconds_per_token=4e-5, intercept_s=0.03, relative_error=0.1,
                      relative_speedup=0.1)


def test_the_judgement_is_served_first_on_the_engines_own_report():
    """What the check weighs: the running step (stopped for the request where it can be), the
    request's own prefill less its cached prefix, at the model's optimistic speed; never the
    queue behind, which a request served first does not wait for."""
    prompt = list(range(3, 3 + 1600))
    queue = [QueuedRequest(20_000, 5.0)] * 8  # 160k tokens waiting: seconds of prefill
    rejected: list[str] = []

    def check(load: ReplicaLoad, slo_ms: float) -> float | None:
        async def report(_timeout: float) -> ReplicaLoad:
            return load

        async def judge() -> float | None:
            try:
                judged = await DoomedCheck(report, rejected.append).check([prompt], slo_ms, 0.0)
            except RequestDoomed as exc:
                return -exc.predicted_ttft_ms
            return judged.optimistic_ttft_s * 1e3

        return asyncio.run(judge())

    now = time.time()
    idle = ReplicaLoad(made_at=now, step_model=MODEL, waiting=queue)
    # 30 ms + 64 ms of prefill, at 90% at best: ~85 ms.
    assert check(idle, 100) == pytest.approx(0.9 * (30 + 64), rel=1e-3)
    assert check(idle, 80) < 0 and rejected == [DOOMED]
    # A long step that cannot be stopped comes first; one that can costs the stop's latency.
    busy = ReplicaLoad(made_at=now, step_model=MODEL, waiting=queue, step_remaining_s=2.0)
    assert check(busy, 1_000) < 0
    stoppable = ReplicaLoad(made_at=now, step_model=MODEL, waiting=queue, step_remaining_s=2.0,
                            step_preemptible=True)
    assert 0 < check(stoppable, 1_000) < 200
    # Its cached prefix is not prefilled again: all its 100 blocks are cached, and only its
    # last token is computed; half of them cached, half of the prompt is.
    hashes = prompt_prefix_hashes(prompt, 16)
    cached = ReplicaLoad(made_at=now, step_model=MODEL, block_size=16,
                         cached_prefix_hashes=hashes)
    assert check(cached, 80) == pytest.approx(0.9 * (30 + 0.04), rel=1e-3)
    half = ReplicaLoad(made_at=now, step_model=MODEL, block_size=16,
                       cached_prefix_hashes=hashes[:50])
    assert check(half, 80) == pytest.approx(0.9 * (30 + 32), rel=1e-3)
