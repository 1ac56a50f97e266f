"""What reading a fleet's deployment status costs the process that asks: `serve.status()`
against the controller's dict read as it comes (engine.fleet.fleet_health.serve_details, what
the ingress's /health reads), on a running fleet.

    sloserve serve MODEL --replicas 3 &        # or any fleet in the local Ray
    python -m bench.diagnostics.fleet_status_cost --calls 20

Both ask Serve's controller the same question; serve.status() then validates the answer into
Ray's pydantic schema, whose RequestRouterConfig cloudpickles the fleet's router class on every
call. Prints, for each, the wall time and this process's CPU time per call (the ingress pays
that CPU on the process that relays every stream), and checks that both give the same status,
replica states and message for every deployment.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


def _per_call(read: Callable[[], Any], calls: int) -> tuple[float, float, Any]:
    """(wall ms, this thread's CPU ms) per call, and the last answer; one call first, untimed."""
    answer = read()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        answer = read()
    return ((time.perf_counter() - wall) / calls * 1e3,
            (time.thread_time() - cpu) / calls * 1e3, answer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto", help="the fleet's Ray (default: auto)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from engine.fleet.fleet_health import _value, serve_details

    if not ray.is_initialized():  # else: this process already runs the fleet (tests)
        ray.init(address=args.address, namespace="serve", log_to_driver=False,
                 configure_logging=False)
    status_wall, status_cpu, status = _per_call(serve.status, args.calls)
    dict_wall, dict_cpu, details = _per_call(serve_details, args.calls)
    print(f"serve.status()                 {status_wall:6.1f} ms wall, {status_cpu:6.1f} ms CPU "
          f"per call")
    print(f"controller's dict (/health)    {dict_wall:6.1f} ms wall, {dict_cpu:6.1f} ms CPU "
          f"per call")
    print(f"CPU ratio                      {status_cpu / max(dict_cpu, 1e-3):.1f}x")
    agree = True
    for app_name, app in status.applications.items():
        for name, overview in app.deployments.items():
            read = details["applications"][app_name]["deployments"][name]
            states = dict(Counter(_value(replica["state"]) for replica in read["replicas"]))
            same = (_value(overview.status) == _value(read["status"])
                    and {_value(k): v for k, v in overview.replica_states.items()} == states
                    and overview.message == read["message"])
            agree &= same
            print(f"{app_name}/{name:22} {_value(read['status'])} {states} "
                  f"{'same as serve.status()' if same else 'DIFFERS from serve.status()'}")
    raise SystemExit(0 if agree else 1)


if __name__ == "__main__":
    main()
