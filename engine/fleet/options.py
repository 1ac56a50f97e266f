"""What a fleet is asked to be (`sloserve serve --replicas N ...`); no Ray import."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

APP_NAME = "sloserve"
ENGINE_DEPLOYMENT = "SloserveEngine"
INGRESS_DEPLOYMENT = "SloserveIngress"
ShutdownMode = Literal["abort", "wait"]
# engine.fleet.routing.RouterPolicy and engine.fleet.admission.OnDoomed, spelled out here so that
# parsing the command line imports neither.
ROUTER_POLICIES = ("slack", "pow2", "least-queue", "round-robin", "prefix")
RouterName = Literal["slack", "pow2", "least-queue", "round-robin", "prefix"]
OnDoomedName = Literal["serve", "reject"]


@dataclass(frozen=True)
class AutoscalingOptions:
    """The deadline autoscaling policy (engine.fleet.autoscaling); None on FleetOptions: a
    fixed number of replicas."""

    min_replicas: int = 1
    max_replicas: int = 4
    # Add a replica when the fleet's predicted urgent attainment over the window falls below
    # this for upscale_delay_s; remove one when every replica's minimum slack stays above
    # downscale_slack_s for downscale_delay_s.
    target_attainment: float = 0.95
    downscale_slack_s: float = 2.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 60.0
    window_s: float = 30.0


@dataclass(frozen=True)
class FleetOptions:
    replicas: int = 2
    router: RouterName = "slack"
    on_doomed: OnDoomedName = "serve"
    # A Ray cluster to join ("auto": the one `ray start --head` started on this node, or
    # "host:port"); None starts Ray in this process.
    address: str | None = None
    report_period_s: float = 0.1
    # On SIGTERM/SIGINT of `sloserve serve --replicas`: let every replica finish its streams
    # (up to the timeout) or stop at once. A replica Ray Serve removes (scale-down, a rolling
    # update, a replaced one) always drains, up to the timeout.
    shutdown_mode: ShutdownMode = "abort"
    shutdown_timeout_s: float = 30.0
    autoscaling: AutoscalingOptions | None = None
    # Ray's resource requests per replica: CPU replicas and simulated ones ask for no whole
    # core (the engine's own threads are what they use); CUDA replicas ask for TP GPUs.
    replica_cpus: float = 0.0
    router_seed: int | None = None
    # Environment for the replicas' processes (the tests' slow-layer hook, thread counts).
    replica_env: dict[str, str] = field(default_factory=dict)
