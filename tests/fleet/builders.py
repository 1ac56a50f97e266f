"""Reports and requests for the fleet policy tests, on a step model simple enough to compute by
hand: prefill(t) = 30 ms + 40 us * t (a 24k prompt in ~1 s, as at GPU time scales), optimistic
at 90% of that, 10% relative error."""

from __future__ import annotations

from engine.load.load_report import QueuedRequest, ReplicaLoad, RouteHint
from monitor.step_time_model import StepTimeModel

NOW = 1_000_000.0
MODEL = StepTimeModel(seconds_per_token=4e-5, intercept_s=0.03, relative_error=0.1,
                      relative_speedup=0.1)


def prefill(tokens: int) -> float:
    return 0.03 + 4e-5 * tokens


def load(*, made_at: float = NOW, waiting=(), running=(), step_remaining_s: float = 0.0,
         step_preemptible: bool = False, slo_preemption: bool = True, num_decoding: int = 0,
         cached=(), num_requests: int | None = None, model: StepTimeModel = MODEL) -> ReplicaLoad:
    def q(item) -> QueuedRequest:
        if isinstance(item, QueuedRequest):
            return item
        tokens, ttd = item
        return QueuedRequest(tokens, ttd)

    waiting = [q(w) for w in waiting]
    running = [q(r) for r in running]
    if num_requests is None:
        num_requests = len(waiting) + len(running) + num_decoding
    return ReplicaLoad(made_at=made_at, step_model=model, waiting=waiting, running=running,
                       num_decoding=num_decoding, step_remaining_s=step_remaining_s,
                       step_preemptible=step_preemptible, slo_preemption=slo_preemption,
                       cached_prefix_hashes=list(cached), num_requests=num_requests,
                       num_blocks=1000, num_free_blocks=500, block_size=16)


def hint(request_id: str = "new", tokens: int = 128, slo: float | None = 0.15,
         arrived_at: float = NOW, prefix=()) -> RouteHint:
    return RouteHint(request_id=request_id, prompt_tokens=tokens, ttft_slo_s=slo,
                     arrived_at=arrived_at, prefix_hashes=list(prefix))
