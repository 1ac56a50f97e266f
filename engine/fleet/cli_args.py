"""`sloserve serve --replicas N ...`: the fleet's flags (no Ray import: `sloserve --help` and
the single-engine server never load it)."""

from __future__ import annotations

import argparse

from engine.entrypoints.arg_types import (float_in, non_negative_float, positive_float,
                                          positive_int)
from engine.fleet.autoscaling import ScalingOptions
from engine.fleet.options import FleetOptions
from engine.fleet.routing import ROUTER_POLICIES


def add_fleet_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "fleet (Ray Serve; needs the `cluster` extra: pip install 'sloserve[cluster]')")
    g.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                   help="serve with N engine replicas on Ray Serve behind one ingress "
                        "(default: one engine, no Ray)")
    g.add_argument("--address", default=None,
                   help="join this Ray cluster ('auto': the one `ray start --head` started "
                        "here; or HOST:PORT) instead of starting Ray in this process")
    g.add_argument("--router", default=FleetOptions.router,
                   choices=ROUTER_POLICIES,
                   help="how the ingress picks a replica: slack (the request's predicted TTFT "
                        "on each replica's slack-ordered queue; the default), pow2 (Ray "
                        "Serve's power of two choices), least-queue (vLLM DP's waiting*4 + "
                        "running), round-robin, prefix (prefix-cache affinity)")
    g.add_argument("--report-period-ms", type=positive_float,
                   default=FleetOptions.report_period_s * 1e3,
                   help="how often each replica reports its queue to the router")
    g.add_argument("--autoscale", action="store_true",
                   help="scale the replicas on predicted urgent attainment (--replicas is the "
                        "initial count)")
    g.add_argument("--min-replicas", type=positive_int, default=ScalingOptions.min_replicas)
    g.add_argument("--max-replicas", type=positive_int, default=None,
                   help="with --autoscale (default: twice --replicas)")
    g.add_argument("--target-attainment", type=float_in(0.0, 1.0, low_open=True),
                   default=ScalingOptions.target_attainment,
                   help="add a replica when the fleet's predicted urgent TTFT attainment falls "
                        "below this")
    g.add_argument("--downscale-slack-s", type=non_negative_float,
                   default=ScalingOptions.downscale_slack_s,
                   help="remove a replica when every replica's minimum slack stays above this")
    g.add_argument("--upscale-delay-s", type=non_negative_float,
                   default=ScalingOptions.upscale_delay_s)
    g.add_argument("--downscale-delay-s", type=non_negative_float,
                   default=ScalingOptions.downscale_delay_s)


def fleet_options(args: argparse.Namespace) -> FleetOptions:
    """The fleet the parsed flags ask for (--shutdown-mode and --shutdown-timeout reach it
    through the server's settings: engine.fleet.launch; --on-doomed, a flag of every server,
    is the ingress's to apply)."""
    autoscaling = None
    if args.autoscale:
        most = args.max_replicas or max(2 * args.replicas, args.min_replicas)
        if args.min_replicas > most:
            raise ValueError(f"--min-replicas {args.min_replicas} is above --max-replicas "
                             f"{most}")
        autoscaling = ScalingOptions(
            min_replicas=args.min_replicas, max_replicas=most,
            target_attainment=args.target_attainment, downscale_slack_s=args.downscale_slack_s,
            upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s)
    return FleetOptions(replicas=args.replicas, router=args.router, on_doomed=args.on_doomed,
                        address=args.address, report_period_s=args.report_period_ms / 1e3,
                        autoscaling=autoscaling)
