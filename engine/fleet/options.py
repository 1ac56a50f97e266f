"""What a fleet is asked to be (`sloserve serve --replicas N ...`); no Ray import."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.fleet.autoscaling import DEFAULT_WINDOW_S, ScalingOptions
from engine.fleet.routing import RouterPolicy
from engine.serving.doomed import OnDoomed

APP_NAME = "sloserve"
ENGINE_DEPLOYMENT = "SloserveEngine"
INGRESS_DEPLOYMENT = "SloserveIngress"


@dataclass(frozen=True)
class FleetOptions:
    replicas: int = 2
    router: RouterPolicy = "slack"
    on_doomed: OnDoomed = "serve"
    # A Ray cluster to join ("auto": the one `ray start --head` started on this node, or
    # "host:port"); None starts Ray in this process.
    address: str | None = None
    report_period_s: float = 0.1
    # The deadline autoscaling policy (engine.fleet.autoscaling); None: `replicas`, fixed.
    autoscaling: ScalingOptions | None = None
    # The window of urgent outcomes each replica reports for it.
    attainment_window_s: float = DEFAULT_WINDOW_S
    # Ray's resource requests per replica: CPU replicas and simulated ones ask for no whole
    # core (the engine's own threads are what they use); CUDA replicas ask for TP GPUs.
    replica_cpus: float = 0.0
    router_seed: int | None = None
    # Environment for the replicas' processes (the tests' slow-layer hook, thread counts).
    replica_env: dict[str, str] = field(default_factory=dict)
