"""Rolling back a scheduled step whose forward pass was abandoned (docs/design.md section 4)."""

from __future__ import annotations

import random

import pytest

from tests.utils.scheduling import (FakeRunner, make_request, make_scheduler, reference_output,
                                    run_to_completion)


def _state(sched):
    """Everything a rollback must restore, in comparable form."""
    kv = sched.kv_cache_manager
    return {
        "requests": {rid: (r.status, r.num_computed_tokens, r.num_cached_tokens,
                           tuple(r.output_token_ids))
                     for rid, r in sched.requests.items()},
        "running": [r.request_id for r in sched.running],
        "waiting": [r.request_id for r in sched.waiting],
        "blocks": {rid: kv.block_ids_from(rid, 0) for rid in kv.req_blocks},
        "free": kv.num_free_blocks,
        "prefix": (kv.prefix_cache_queries, kv.prefix_cache_hits),
        "prev": sched.prev_scheduled_req_ids,
    }


def _plan(out):
    return [(r.req_id, tuple(r.token_ids), r.start_pos, r.block_table_start, tuple(r.block_ids),
             r.sample)
            for r in out.requests]


def test_rollback_restores_state_and_the_step_reschedules_identically():
    sched = make_scheduler(num_blocks=64, budget=24)
    runner = FakeRunner(sched)
    for rid, n in (("a", 30), ("b", 9)):
        sched.add_request(make_request(rid, n))
    for _ in range(2):  # a is mid-prefill, b decoding
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    sched.add_request(make_request("c", 17))
    sched.add_request(make_request("d", 5))
    before = _state(sched)
    out = sched.schedule()  # decodes, a's next chunk, and admissions of c (and maybe d)
    assert any(r.req_id in ("c", "d") for r in out.requests), "probe: the step admitted someone"
    sched.rollback(sched.last_step_record)
    sched.check_invariants()
    assert _state(sched) == before
    again = sched.schedule()
    assert again.step_id == out.step_id + 1  # step ids are never reused
    assert _plan(again) == _plan(out)


def test_rollback_of_a_step_with_prefix_hits_undoes_the_counters():
    sched = make_scheduler(num_blocks=64, budget=64)
    runner = FakeRunner(sched)
    shared = list(range(1, 17))
    sched.add_request(make_request("a", shared + [20, 21], max_tokens=2))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", shared + [30, 31], max_tokens=2))
    before = _state(sched)
    out = sched.schedule()
    assert sched.kv_cache_manager.prefix_cache_hits > before["prefix"][1], "probe: a cache hit"
    sched.rollback(sched.last_step_record)
    assert _state(sched) == before
    assert _plan(sched.schedule()) == _plan(out)


def test_kv_preemption_in_a_rolled_back_step_stays_preempted():
    sched = make_scheduler(num_blocks=12, budget=64)
    runner = FakeRunner(sched)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, 14, max_tokens=12, ignore_eos=True))
    preempted = None
    for _ in range(200):
        out = sched.schedule()
        if sched.last_step_record.kv_preempted:
            preempted = [r.request_id for r in sched.last_step_record.kv_preempted]
            break
        sched.update_from_output(out, runner.execute(out))
    assert preempted, "probe: the pool was small enough to force a KV preemption"
    sched.rollback(sched.last_step_record)
    sched.check_invariants()
    for rid in preempted:
        assert sched.requests[rid].num_computed_tokens == 0
        assert rid in [r.request_id for r in sched.waiting]


@pytest.mark.parametrize("seed", range(6))
def test_random_rollbacks_never_change_outputs(seed):
    """Roll back a random third of the steps of a busy run: outputs equal the reference, and all
    blocks are free at the end."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=40, budget=rng.choice([8, 16, 32]))
    runner = FakeRunner(sched)
    requests = [make_request(f"r{i}", rng.randrange(3, 40), max_tokens=rng.randrange(1, 12),
                             ignore_eos=True) for i in range(8)]
    for r in requests:
        sched.add_request(r)
    expected = {r.request_id: reference_output(r.prompt_token_ids, r.sampling_params, None,
                                               sched.max_model_len) for r in requests}
    outputs, rollbacks = {}, 0
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.check_invariants()
        if out.requests and rng.random() < 0.33:
            sched.rollback(sched.last_step_record)
            rollbacks += 1
            sched.check_invariants()
            continue
        for r in sched.update_from_output(out, runner.execute(out)):
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
    assert rollbacks > 0
    assert outputs == expected
    assert sched.kv_cache_manager.num_free_blocks == 40


def test_only_the_last_step_can_be_rolled_back():
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5))
    first = sched.schedule()
    record = sched.last_step_record
    sched.update_from_output(first, runner.execute(first))
    sched.schedule()
    with pytest.raises(ValueError, match="only the last step"):
        sched.rollback(record)
