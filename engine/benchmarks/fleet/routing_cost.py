"""What a routing decision costs: `FleetBook.rank` for each policy, and the slack policy with
admission (`assess`) on the same predictions, per decision, at a fleet's scale.

The fleet: `--replicas` replicas (8), each reporting `--queued` requests (32; a third without a
deadline, the rest with deadlines from 100 ms to 5 s), one or two running prefills (half of
the replicas preemptible), 16 decodes and `--prefix-hashes` cached prefix hashes (4096), with a
few requests sent since each report and `--recent` (50) sent in the arrival window before it
(completed: the router's forecast of what will overtake a request, engine/load/arrivals.py).
Requests: 4096-token prompts (256 block hashes), half of them sharing a cached document's
prefix, three in four with an objective. Times are of the pure policy code on this machine's
CPU (the Ray glue around it is not counted).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

from engine.fleet.admission import assess
from engine.load.load_report import QueuedRequest, ReplicaLoad, RouteHint
from engine.fleet.routing import ROUTER_POLICIES, FleetBook
from monitor.step_time_model import StepTimeModel

# Section 9's orders of magnitude: a 24k-token prefill ~1 s, a step's intercept ~30 ms.
MODEL = StepTimeModel(seconds_per_token=4e-5, intercept_s=0.03, relative_error=0.1,
                      relative_speedup=0.1)
BLOCK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="routing_cost", description="Per-decision cost of the fleet router's policies.")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--queued", type=int, default=32, help="queued requests per replica")
    parser.add_argument("--prefix-hashes", type=int, default=4096,
                        help="cached prefix hashes per report")
    parser.add_argument("--unreported", type=int, default=2,
                        help="requests sent to each replica since its report")
    parser.add_argument("--recent", type=int, default=50,
                        help="requests with an objective sent to each replica in the arrival "
                             "window (the forecast); 50 is 80 req/s over 8 replicas for 5 s")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def build_fleet(args: argparse.Namespace, now: float) -> tuple[FleetBook, list[RouteHint]]:
    rng = random.Random(args.seed)
    book = FleetBook(seed=args.seed)
    documents = [[rng.getrandbits(63) for _ in range(256)] for _ in range(4)]
    for r in range(args.replicas):
        waiting = [QueuedRequest(rng.randint(64, 8192),
                                 None if rng.random() < 1 / 3 else rng.uniform(0.1, 5.0))
                   for _ in range(args.queued)]
        running = [QueuedRequest(rng.randint(2048, 30_000), None if i else rng.uniform(0.5, 3))
                   for i in range(rng.randint(1, 2))]
        cached = documents[r % len(documents)] + [
            rng.getrandbits(63) for _ in range(max(0, args.prefix_hashes - 256))]
        load = ReplicaLoad(made_at=now - rng.uniform(0, 0.1), step_model=MODEL,
                           waiting=waiting, running=running, num_decoding=16,
                           decode_context=16 * 2000, step_remaining_s=rng.uniform(0.05, 1.2),
                           step_preemptible=r % 2 == 0, num_blocks=10_000,
                           num_free_blocks=2000, block_size=BLOCK_SIZE,
                           cached_prefix_hashes=cached[-args.prefix_hashes:],
                           num_requests=len(waiting) + len(running) + 16)
        rid = f"replica-{r}"
        window = book.arrival_window_s
        for i in range(args.recent):
            at = now - window + window * i / max(1, args.recent)
            sent = RouteHint(request_id=f"{rid}-recent-{i}",
                             prompt_tokens=rng.randint(64, 30_000),
                             ttft_slo_s=rng.choice([0.15, 0.3, 1.0, 10.0, 30.0]),
                             arrived_at=at)
            book.on_sent(rid, sent, at)
            book.on_completed(rid, sent.request_id)
        book.on_report(rid, load)
        for i in range(args.unreported):
            book.on_sent(rid, RouteHint(request_id=f"{rid}-sent-{i}",
                                        prompt_tokens=rng.randint(64, 4096),
                                        ttft_slo_s=rng.choice([None, 0.3, 1.0]),
                                        arrived_at=now), now)
    hints = []
    for i in range(64):
        prefix = (documents[rng.randrange(len(documents))] if rng.random() < 0.5
                  else [rng.getrandbits(63) for _ in range(256)])
        hints.append(RouteHint(request_id=f"req-{i}", prompt_tokens=4096,
                               ttft_slo_s=None if i % 4 == 3 else rng.choice([0.15, 0.3, 1.0]),
                               arrived_at=now, prefix_hashes=prefix))
    return book, hints


def _time(decide: Callable[[RouteHint, float], object], hints: Sequence[RouteHint],
          now: float, decisions: int) -> tuple[list[float], list[float]]:
    """Microseconds per decision: wall clock, and this thread's CPU time (what the decision
    costs where other processes share the cores, as on a loaded test machine)."""
    wall, cpu = [], []
    for i in range(decisions):
        hint = hints[i % len(hints)]
        t = now + 1e-4 * i / decisions  # the reports age a little, as they would
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decide(hint, t)
        cpu.append((time.thread_time_ns() - start_cpu) / 1e3)
        wall.append((time.perf_counter_ns() - start) / 1e3)
    return wall, cpu


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return (ordered[len(ordered) // 2],
            ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    now = time.time()
    book, hints = build_fleet(args, now)
    ids = list(book.replicas)

    def slack_with_admission(hint: RouteHint, t: float) -> object:
        predictions = book.predictions(ids, hint, t)
        return book.rank("slack", ids, hint, t, predictions), assess(book, hint, t, ids,
                                                                       predictions)

    cases: dict[str, Callable[[RouteHint, float], object]] = {
        policy: (lambda h, t, policy=policy: book.rank(policy, ids, h, t))
        for policy in ROUTER_POLICIES}
    cases["slack+admission"] = slack_with_admission
    print(f"routing cost: {args.replicas} replicas x {args.queued} queued, "
          f"{args.prefix_hashes} prefix hashes, {args.unreported} unreported sends and "
          f"{args.recent} recent ones each, {args.decisions} decisions")
    print(f"{'policy':<18}{'wall p50 us':>12}{'wall p99 us':>12}{'cpu p50 us':>12}"
          f"{'cpu p99 us':>12}{'cpu mean us':>12}")
    for name, decide in cases.items():
        _time(decide, hints, now, min(200, args.decisions))  # warm-up
        wall, cpu = _time(decide, hints, now, args.decisions)
        (w50, w99), (c50, c99) = _percentiles(wall), _percentiles(cpu)
        print(f"{name:<18}{w50:>12.1f}{w99:>12.1f}{c50:>12.1f}{c99:>12.1f}"
              f"{statistics.fmean(cpu):>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
