"""`slo` is the default policy, and without deadlines it is fcfs: the same randomized
no-SLO trace, under KV pressure (recompute preemptions) and chunked prefill, gives the same
schedule step by step under both policies."""

from __future__ import annotations

import random

import pytest

from engine.config import SchedulerConfig, build_engine_config
from engine.entrypoints.cli import build_parser
from tests.utils.scheduling import FakeRunner, make_request, make_scheduler


def _schedule_of(policy: str, seed: int) -> tuple[list[list[tuple[str, int, int]]], int]:
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=40, budget=48, max_num_seqs=6, policy=policy)
    runner = FakeRunner(sched)
    arrivals: dict[int, list] = {}
    for i in range(30):
        step = rng.randrange(60)
        # Arrival times in the order of submission, as a clock would give them.
        arrival = step + len(arrivals.get(step, [])) / 100
        arrivals.setdefault(step, []).append(
            make_request(f"r{i}", rng.randrange(4, 120), max_tokens=rng.randrange(1, 40),
                         ignore_eos=True, arrival=arrival))
    steps = []
    for step in range(2000):
        for request in arrivals.pop(step, []):
            sched.add_request(request)
        if not arrivals and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        steps.append([(r.req_id, r.start_pos, len(r.token_ids)) for r in out.requests])
        sched.update_from_output(out, runner.execute(out))
        sched.check_invariants()
    return steps, sched.num_kv_preemptions


@pytest.mark.parametrize("seed", range(4))
def test_without_deadlines_slo_schedules_exactly_as_fcfs(seed):
    fcfs, fcfs_preemptions = _schedule_of("fcfs", seed)
    slo, _ = _schedule_of("slo", seed)
    assert fcfs_preemptions > 0  # probe: the trace really preempts (and re-admits) requests
    assert sum(len(s) > 1 for s in fcfs) > 10  # ... and batches several requests per step
    assert slo == fcfs


def test_slo_with_suspend_is_the_default_everywhere():
    assert SchedulerConfig().policy == "slo"
    config = build_engine_config("/some/model")
    assert config.scheduler.policy == "slo"
    assert config.slo_preemption.enabled and config.slo_preemption.mode == "suspend"
    args = build_parser().parse_args(["serve"])
    assert (args.scheduling_policy, args.slo_preemption, args.slo_preempt_mode) == \
        ("slo", "on", "suspend")
