"""Start a fleet: N sloserve replicas and the ingress as one Ray Serve application.

`sloserve serve MODEL --replicas N` calls `serve_fleet`; tests and `sloserve bench run
--replicas N` use `running_fleet`. Ray Serve places the replicas (a tensor-parallel replica gets
one bundle of `TP` GPUs, packed on one node), checks their health, replaces a dead one, scales
them (with the deadline policy when asked) and drains one it removes; this module only says how.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict

import httpx

from engine.config import EngineConfig
from engine.fleet.options import (APP_NAME, ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT,
                                  FleetOptions)
from engine.fleet.ingress_http import bind_listener
from engine.serving.api_server import ServerSettings

logger = logging.getLogger(__name__)

# Ray Serve settings for a Ray this process starts (the processes Ray spawns inherit them):
# Ray's documented RAY_SERVE_THROUGHPUT_OPTIMIZED mode. The ingress hands each request to its
# replica, and relays every response chunk back, over gRPC rather than as Ray objects (on a busy
# host the object path added tens of ms to first tokens); user code runs on each replica's own
# event loop, not a thread beside it (a hop per request and per chunk); Serve's
# per-request logs are buffered and go to its log files only
# (/tmp/ray/session_latest/logs/serve/), not through the driver's stderr. Under a flood on a
# 2-core host this took the urgent turns' TTFT p50 from 420 to 182 ms at four times slower
# (bench/RESULTS.md, Overload). Two settings of that mode are turned back. The router runs on an
# event loop of its own (a thread in the ingress's process), not on the ingress's loop. That
# loop reads every HTTP request of a flood and relays every stream, and a request's router
# there began choosing its replica 84-233 ms after the request arrived, the replica's
# acceptance coming back behind the same queue; on its own loop the router chooses within
# 5-65 ms. Under the same flood four times slower the urgent turns' TTFT p50 went from 150-178
# to 101-130 ms; the price is a hop between the two loops for every chunk the ingress relays
# (bench/RESULTS.md, Overload). And Ray Serve's direct ingress is off: the ingress serves HTTP
# itself (engine.fleet.ingress_http). A value already in the environment wins. A cluster joined
# with --address keeps the settings it was started with (the README's `ray start` lines set
# these).
RAY_SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                 "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
                 "RAY_SERVE_PROXY_USE_GRPC": "1",
                 "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


# What init_ray put into this process's environment (a later Ray started here replaces it).
_set_here: dict[str, str] = {}


def init_ray(address: str | None = None, **ray_init_kwargs) -> None:
    """Start Ray (or join the cluster at `address`) with the fleet's Ray Serve settings, unless
    the environment already says otherwise."""
    import ray

    settings = dict(RAY_SERVE_ENV)
    for name, value in _set_here.items():  # an earlier Ray of this process's, not the user's
        if os.environ.get(name) == value:
            del os.environ[name]
    _set_here.clear()
    for name, value in settings.items():
        if name not in os.environ:
            os.environ[name] = _set_here[name] = value
    ray_init_kwargs.setdefault("include_dashboard", False)
    ray_init_kwargs.setdefault("configure_logging", False)
    ray.init(address=address, **ray_init_kwargs)


def build_fleet_app(config: EngineConfig, settings: ServerSettings, options: FleetOptions,
                    host: str = "127.0.0.1", port: int = 8000):
    """The Ray Serve application: the engine deployment and the ingress bound to it, serving
    HTTP on (host, port) of the node this process runs on."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from engine.fleet.ingress import FleetIngress, IngressSettings
    from engine.fleet.replica import EngineReplica

    gpus = config.tensor_parallel_size if config.model.device == "cuda" else 0
    actor_options: dict = {"num_cpus": options.replica_cpus}
    if options.replica_env:
        actor_options["runtime_env"] = {"env_vars": dict(options.replica_env)}
    placement: dict = {}
    if gpus:
        actor_options["num_gpus"] = gpus
        # The replica's TP workers are its own processes and use the GPUs Ray gave the actor:
        # one bundle, on one node.
        placement = {"placement_group_bundles": [{"CPU": max(1.0, options.replica_cpus),
                                                  "GPU": gpus}],
                     "placement_group_strategy": "STRICT_PACK"}
        actor_options["num_cpus"] = max(1.0, options.replica_cpus)
    scaling: dict = {"num_replicas": options.replicas}
    if options.autoscaling is not None:
        auto = options.autoscaling
        scaling = {"autoscaling_config": {
            "min_replicas": auto.min_replicas, "max_replicas": auto.max_replicas,
            "initial_replicas": min(max(options.replicas, auto.min_replicas), auto.max_replicas),
            # Ray reads the replicas' record_autoscaling_stats this often.
            # The policy keeps its own delays; Ray's would be applied on top of them.
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "metrics_interval_s": max(options.report_period_s, 0.5),
            "look_back_period_s": max(2 * options.report_period_s, 1.0),
            "policy": {"policy_function":
                       "engine.fleet.autoscaling:DeadlineAutoscalingPolicy",
                       "policy_kwargs": asdict(auto)}}}
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT,
        ray_actor_options=actor_options, **placement, **scaling,
        # The engine queues and orders requests itself (by slack): Ray Serve must not hold
        # them back at the router.
        max_ongoing_requests=4096,
        # One line per request and per report from every replica is noise at serving rates;
        # the ingress's /metrics counts what matters.
        logging_config={"enable_access_log": False},
        health_check_period_s=1.0, health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5,
        # A replica Ray Serve removes takes no new requests and finishes its streams first.
        graceful_shutdown_timeout_s=settings.shutdown.timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class="engine.fleet.ray_router:DeadlineRouter",
            request_router_kwargs={"policy": options.router,
                                   "report_period_s": options.report_period_s,
                                   "seed": options.router_seed},
            request_routing_stats_period_s=options.report_period_s,
            request_routing_stats_timeout_s=max(1.0, 10 * options.report_period_s)),
    ).bind(config, _replica_settings(settings), options.attainment_window_s)
    ingress_settings = IngressSettings(
        engine_deployment=ENGINE_DEPLOYMENT, host=host, port=port,
        shutdown_timeout_s=settings.shutdown.timeout_s, on_doomed=options.on_doomed,
        api_key=settings.api_key, max_request_body_bytes=settings.max_request_body_bytes,
        default_ttft_slo_ms=settings.default_ttft_slo_ms)
    # The ingress binds the fleet's port on this node, where `sloserve serve` was asked for it.
    this_node = f"node:{ray.util.get_node_ip_address()}"
    return serve.deployment(
        FleetIngress, name=INGRESS_DEPLOYMENT,
        ray_actor_options={"num_cpus": 0, "resources": {this_node: 0.001}},
        max_ongoing_requests=8192, logging_config={"enable_access_log": False},
        # Its open streams finish before it stops (IngressHttpServer.stop).
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=settings.shutdown.timeout_s + 5.0,
    ).bind(engine, config, ingress_settings)


def _replica_settings(settings: ServerSettings) -> ServerSettings:
    """The replicas sit behind the ingress, which checks the API key and judges doomed
    requests over the whole fleet (--on-doomed: a replica refusing by its own queue would
    refuse what the router sent it on purpose); each still enforces the server's own limits
    and SLO rules."""
    from dataclasses import replace

    return replace(settings, api_key=None, metrics_require_api_key=False, on_doomed="serve")


def start_fleet(config: EngineConfig, settings: ServerSettings, options: FleetOptions,
                host: str = "127.0.0.1", port: int = 8000, ready_timeout_s: float = 600.0
                ) -> str:
    """Start Ray (or join `options.address`) and the fleet; returns the base URL once every
    replica reports. RuntimeError, before anything is deployed, when (host, port) cannot be
    bound here."""
    import ray
    from ray import serve

    # The ingress binds it on this node once Ray has placed it: a port in use is said now.
    try:
        bind_listener(host, port).close()
    except OSError as exc:
        raise RuntimeError(str(exc)) from exc
    if not ray.is_initialized():
        init_ray(options.address, log_to_driver=True)
    # The ingress serves HTTP itself: Ray Serve starts no HTTP proxy, and the application has
    # no route of Ray Serve's (whose URL Ray would log as the application's).
    serve.start(proxy_location="Disabled")
    serve.run(build_fleet_app(config, settings, options, host, port), name=APP_NAME,
              route_prefix=None, blocking=False)
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    url = (f"http://[{client_host}]:{port}" if ":" in client_host
           else f"http://{client_host}:{port}")
    wait_until_ready(url, ready_timeout_s)
    return url


def wait_until_ready(url: str, timeout_s: float) -> dict:
    """Poll the ingress's /health until it says ok (every replica reports)."""
    deadline = time.monotonic() + timeout_s
    last: dict | str = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=5.0)
            last = response.json()
            if response.status_code == 200 and last.get("status") == "ok":
                return last
        except (httpx.HTTPError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(0.5)
    raise RuntimeError(f"the fleet was not ready within {timeout_s:.0f} s: /health said {last}")


def stop_fleet(shutdown_ray: bool = True) -> None:
    import ray
    from ray import serve

    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)
    if shutdown_ray:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def running_fleet(config: EngineConfig, settings: ServerSettings, options: FleetOptions,
                  port: int = 8000, keep_ray: bool = False) -> Iterator[str]:
    """A fleet for the length of a `with` block (tests, benchmarks): yields its base URL;
    `keep_ray` leaves Ray running for the next fleet (a test session shares one Ray)."""
    url = start_fleet(config, settings, options, port=port)
    try:
        yield url
    finally:
        stop_fleet(shutdown_ray=not keep_ray)


def serve_fleet(config: EngineConfig, settings: ServerSettings, options: FleetOptions,
                host: str, port: int) -> None:
    """`sloserve serve MODEL --replicas N`: runs until SIGINT or SIGTERM, then stops: with
    --shutdown-mode wait each replica finishes its streams first (up to --shutdown-timeout, as
    a replica Ray Serve removes always does), with abort at once."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = start_fleet(config, settings, options, host=host, port=port)
    where = f"Ray cluster at {options.address}" if options.address else "a local Ray"
    print(f"sloserve fleet: {options.replicas} replicas ({options.router} router) on {where}, "
          f"serving at {url}", flush=True)
    try:
        stop.wait()
    finally:
        print(f"sloserve fleet: stopping ({settings.shutdown.mode})", flush=True)
        if settings.shutdown.mode == "wait":
            stop_fleet(shutdown_ray=options.address is None)  # each replica drains first
        else:
            _abort_fleet(options.address is None)


def _abort_fleet(shutdown_ray: bool) -> None:
    """Stop without waiting for streams: the replicas' actors are killed, their EngineCore
    processes see the socket close and exit."""
    import ray
    from ray import serve

    if shutdown_ray:
        ray.shutdown()
    else:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME, _blocking=False)
