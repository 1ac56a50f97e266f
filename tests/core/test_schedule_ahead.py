"""Async scheduling at the scheduler: the next decode step scheduled before the one in flight is
committed (Scheduler.can_schedule_ahead, Request.num_output_placeholders).

The fake runner feeds a decode scheduled ahead from its previous step's samples, as the model
runner does on the device, and samples from the history it reads back through the block
tables: a wrong slot, position or placeholder changes the output, which must equal the
straight-line reference. Each test also checks that decodes really were scheduled ahead.
"""

from __future__ import annotations

import random

import pytest

from engine.core.request import RequestStatus
from engine.core.scheduler_output import PENDING_TOKEN, SchedulerOutput
from tests.utils.scheduling import (BS, VOCAB, FakeRunner, make_request, make_scheduler,
                                    next_token, reference_output, run_ahead_to_completion,
                                    run_to_completion)


def test_decodes_scheduled_ahead_give_the_reference_outputs() -> None:
    sched = make_scheduler(budget=16)
    reqs = [make_request(f"r{i}", 3 + 5 * i, max_tokens=6 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outputs, ahead = run_ahead_to_completion(sched, FakeRunner(sched))
    assert ahead > 0
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params,
                                                         None, 256)
        assert r.num_output_placeholders == 0
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_a_decode_scheduled_ahead_names_its_pending_input() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    req = make_request("a", [1, 2, 3], max_tokens=5)
    sched.add_request(req)
    prefill = sched.schedule()
    first = runner.execute(prefill)
    assert req.num_output_placeholders == 1 and sched.can_schedule_ahead()
    ahead = sched.schedule()
    (sr,) = ahead.requests
    assert (sr.token_ids, sr.last_token_pending, sr.start_pos, sr.num_output_tokens,
            sr.sample) == ([PENDING_TOKEN], True, 3, 1, True)
    assert req.num_output_placeholders == 2
    sched.update_from_output(prefill, first)
    assert req.output_token_ids == [next_token([1, 2, 3])]
    assert req.num_output_placeholders == 1
    sched.update_from_output(ahead, runner.execute(ahead))
    assert req.output_token_ids == reference_output([1, 2, 3], req.sampling_params, None, 256)[:2]
    sched.check_invariants()


def test_stops_are_seen_a_step_late_and_the_token_computed_ahead_is_dropped() -> None:
    prompt = [1, 2, 3]
    first = next_token(prompt)
    sched = make_scheduler(num_blocks=8, max_model_len=12)
    eos = make_request("eos", prompt, max_tokens=5, eos=first)
    stop = make_request("stop", prompt, max_tokens=5, stop_token_ids=[first])
    mml = make_request("mml", prompt, max_tokens=100)
    length = make_request("len", prompt, max_tokens=4)
    for r in (eos, stop, mml, length):
        sched.add_request(r)
    outputs, ahead = run_ahead_to_completion(sched, FakeRunner(sched))
    assert ahead > 0
    assert eos.status is RequestStatus.FINISHED_STOPPED and outputs["eos"] == [first]
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == first
    # Never scheduled past its limits: a decode ahead may not write beyond max_model_len.
    assert mml.status is RequestStatus.FINISHED_LENGTH and mml.num_tokens == 12
    assert length.num_output_tokens == 4
    assert sched.num_free_blocks == 8


def test_kv_preemption_in_steps_scheduled_ahead_recomputes_the_same_tokens() -> None:
    sched = make_scheduler(num_blocks=8, budget=16)
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=12) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outputs, ahead = run_ahead_to_completion(sched, FakeRunner(sched))
    assert ahead > 0 and sched.num_kv_preemptions > 0
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params,
                                                         None, 32)
    assert sched.num_free_blocks == 8


def test_requests_that_read_their_history_are_never_scheduled_ahead() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("plain", 5, max_tokens=4))
    sched.add_request(make_request("penalized", 5, max_tokens=4, repetition_penalty=1.2))
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()
    assert not sched.can_schedule_ahead()
    sched.update_from_output(out, runner.execute(out))
    assert not any(r.last_token_pending for r in sched.schedule().requests)


def test_a_waiting_request_drains_the_pipeline() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5, max_tokens=8))
    out = sched.schedule()
    flight = (out, runner.execute(out))
    assert sched.can_schedule_ahead()
    sched.add_request(make_request("b", 5, max_tokens=8))
    assert not sched.can_schedule_ahead()
    sched.update_from_output(*flight)
    out = sched.schedule()
    assert not any(r.last_token_pending for r in out.requests)
    assert {r.req_id for r in out.requests} == {"a", "b"}


def test_a_rolled_back_step_gives_back_its_placeholders() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    a = make_request("a", 5, max_tokens=8)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    b = make_request("b", 6, max_tokens=8)
    sched.add_request(b)
    out = sched.schedule()  # a's decode and b's prefill, both sampling
    assert (a.num_output_placeholders, b.num_output_placeholders) == (1, 1)
    assert sched.last_step_record is not None
    sched.rollback(sched.last_step_record)
    assert (a.num_output_placeholders, b.num_output_placeholders) == (0, 0)
    sched.check_invariants()
    outputs = run_to_completion(sched, runner)
    for r in (a, b):
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params,
                                                         None, 256)


@pytest.mark.parametrize("seed", range(8))
def test_random_stress_ahead(seed: int) -> None:
    """Arrivals and aborts between steps, a small pool, stops: every output as the reference."""
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 14)
    max_model_len = num_blocks * BS - rng.randint(0, 3)
    sched = make_scheduler(num_blocks, max_model_len, budget=rng.randint(8, 40),
                           max_num_seqs=rng.randint(2, 6), prefix=rng.random() < 0.8)
    runner = FakeRunner(sched)
    pending = [make_request(f"r{i}", rng.randint(1, 16), max_tokens=rng.randint(1, 24),
                            eos=rng.choice([None, rng.randrange(VOCAB)]))
               for i in range(30)]
    all_reqs = list(pending)
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    in_flight: tuple[SchedulerOutput, object] | None = None
    ahead = 0

    def commit() -> None:
        nonlocal in_flight
        assert in_flight is not None
        for r in sched.update_from_output(*in_flight):  # type: ignore[arg-type]
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
        in_flight = None

    for _ in range(5_000):
        if not pending and not sched.has_unfinished_requests() and in_flight is None:
            break
        for _ in range(rng.randint(0, 1)):
            if pending and rng.random() < 0.3:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(list(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        if in_flight is not None and not sched.can_schedule_ahead():
            commit()
        if not sched.has_unfinished_requests():
            continue
        out = sched.schedule()
        sched.check_invariants()
        ahead += sum(r.last_token_pending for r in out.requests)
        ran = (out, runner.execute(out))
        if in_flight is not None:
            commit()
        in_flight = ran
        sched.check_invariants()
    else:
        raise AssertionError("livelock")
    assert ahead > 0
    assert sched.num_free_blocks == num_blocks
    for r in all_reqs:
        if r.request_id in aborted:
            continue
        expected = reference_output(r.prompt_token_ids, r.sampling_params, r.eos_token_id,
                                    max_model_len)
        assert outputs[r.request_id] == expected, r.request_id

