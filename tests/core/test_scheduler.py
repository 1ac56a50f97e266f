"""Scheduler: token budget, chunking, admission, preemption, prefix caching, stop checks.

A fake runner stands in for the model: it writes each scheduled token into a simulated paged KV cache
at the slots the block table names, and "samples" a deterministic function of the history it reads
back through the block table. Any wrong block id, stale block or bad prefix-cache hit therefore
changes the output, which is compared with a straight-line reference generation.
"""

from __future__ import annotations

import random

import pytest

from engine.core.request import Request, RequestStatus
from engine.core.request_queue import FCFSQueue, PriorityQueue, create_request_queue
from engine.core.scheduler_output import ModelRunnerOutput, StepStatus
from tests.utils.scheduling import (BS, VOCAB, next_token, reference_output, FakeRunner,
                                    make_scheduler, make_request, step, run_to_completion,
                                    scheduled)

# ---- basics ---------------------------------------------------------------------------------


def test_step_ids_strictly_increase_from_one() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    ids = [sched.schedule().step_id for _ in range(2)]  # empty steps still get ids
    sched.add_request(make_request("a", 5, max_tokens=3))
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        ids.append(out.step_id)
    assert ids == list(range(1, len(ids) + 1))


def test_scheduled_request_fields() -> None:
    sched = make_scheduler(budget=6)
    runner = FakeRunner(sched)
    req = make_request("a", list(range(10)), max_tokens=2)
    sched.add_request(req)
    out, got = step(sched, runner)
    (sr,) = out.requests
    assert (sr.token_ids, sr.start_pos, sr.sample, sr.num_output_tokens) == ([0, 1, 2, 3, 4, 5], 0, False, 0)
    assert len(sr.block_ids) == 2 and got == []
    out, got = step(sched, runner)
    (sr,) = out.requests
    assert (sr.token_ids, sr.start_pos, sr.sample) == ([6, 7, 8, 9], 6, True)
    # The workers hold the first two blocks: only the third is sent.
    assert (sr.block_table_start, len(sr.block_ids)) == (2, 1)
    assert got == [req] and req.first_token_time is not None
    out, got = step(sched, runner)
    (sr,) = out.requests
    assert (sr.start_pos, sr.sample, sr.num_output_tokens) == (10, True, 1)
    assert sr.token_ids == [req.output_token_ids[0]]
    assert req.status is RequestStatus.FINISHED_LENGTH and req.finish_time is not None
    assert not sched.has_unfinished_requests()


def test_outputs_match_reference() -> None:
    sched = make_scheduler(budget=16)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", 3 + 5 * i, max_tokens=6) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, runner)
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params, None, 256)
    assert sched.kv_cache_manager.num_free_blocks == 64


# ---- budget and chunking --------------------------------------------------------------------


def test_chunking_clamps_to_remaining_budget() -> None:
    sched = make_scheduler(budget=40)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 30))
    sched.add_request(make_request("b", 30))
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 30, "b": 10}
    assert [r.sample for r in out.requests] == [True, False]
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 20}
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 1}


def test_long_prefill_threshold_limits_each_chunk() -> None:
    sched = make_scheduler(budget=64, threshold=8)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 5))
    chunks = []
    for _ in range(3):
        out, _ = step(sched, runner)
        chunks.append(scheduled(out))
    assert chunks == [{"a": 8, "b": 5}, {"a": 8, "b": 1}, {"a": 4, "b": 1}]


def test_max_num_seqs_limits_admissions() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    for name in "abc":
        sched.add_request(make_request(name, 4))
    out, _ = step(sched, runner)
    assert list(scheduled(out)) == ["a", "b"] and sched.num_waiting == 1


def test_chunked_prefill_off_big_prompt_waits_and_blocks_the_queue() -> None:
    sched = make_scheduler(num_blocks=32, max_model_len=32, budget=32, chunked=False)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("big", 32, max_tokens=1))
    sched.add_request(make_request("small", 2, max_tokens=1))
    out, _ = step(sched, runner)
    # 28 tokens of budget left: "big" does not fit whole and "small" may not jump ahead of it.
    assert scheduled(out) == {"a": 4}
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1}
    assert sched.get_request("big").status is RequestStatus.WAITING  # type: ignore[union-attr]
    run_to_completion(sched, runner)


def test_chunked_prefill_off_admits_whole_prompt_when_it_fits() -> None:
    sched = make_scheduler(num_blocks=32, max_model_len=32, budget=32, chunked=False, threshold=4)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 20, max_tokens=1))
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 20}


def test_chunked_prefill_off_requires_budget_for_max_model_len() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(num_blocks=32, max_model_len=64, budget=32, chunked=False)


# ---- admission control ----------------------------------------------------------------------


def test_watermark_applies_to_admissions_only() -> None:
    # 10 blocks, watermark 0.2 -> 2 blocks held back from admissions while something runs.
    sched = make_scheduler(num_blocks=10, budget=64, watermark=0.2)
    runner = FakeRunner(sched)
    a = make_request("a", 28, max_tokens=20)  # 7 blocks, grows to max_model_len = 40
    b = make_request("b", 8, max_tokens=1)  # 2 blocks: more than 3 free - 2 reserved
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 28}
    assert sched.num_free_blocks == 3 and b.status is RequestStatus.WAITING
    min_free = sched.num_free_blocks
    while a.status is RequestStatus.RUNNING:
        out, _ = step(sched, runner)
        min_free = min(min_free, sched.num_free_blocks)
        if a.status is RequestStatus.RUNNING:
            assert b.status is RequestStatus.WAITING
    # The running request took the last blocks, including the reserve, and was never preempted.
    assert min_free == 0 and a.num_preemptions == 0
    assert a.status is RequestStatus.FINISHED_LENGTH and a.num_tokens == 40
    out, _ = step(sched, runner)
    assert scheduled(out) == {"b": 8}


def test_full_sequence_admission_reserves_the_input_not_max_tokens() -> None:
    """The check covers the input (prompt + tokens generated so far), as vLLM's
    scheduler_reserve_full_isl does; decode growth is left to KV preemption."""
    sched = make_scheduler(num_blocks=10, full_seq=True)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, max_tokens=24, ignore_eos=True))  # grows to 8 blocks
    sched.add_request(make_request("b", 4, max_tokens=36, ignore_eos=True))  # grows to 10 blocks
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 8, "b": 4}
    outputs = run_to_completion(sched, runner)
    assert set(outputs) == {"a", "b"}
    # Probe: the pool really was too small for both full sequences, and preemption handled it.
    assert sched.num_kv_preemptions > 0
    assert sched.num_free_blocks == 10


def test_cli_sets_the_admission_knobs() -> None:
    from engine.entrypoints.cli import build_parser
    from engine.entrypoints.engine_args import engine_kwargs
    from engine.config import build_engine_config

    def config(*flags: str):
        args = build_parser().parse_args(["generate", "hi", *flags])
        kwargs = engine_kwargs(args)
        kwargs.pop("model")
        return build_engine_config("unused", **kwargs)

    default = config()
    assert default.cache.watermark == 0.01 and default.scheduler.full_sequence_admission
    custom = config("--watermark", "0.2", "--no-full-sequence-admission")
    assert custom.cache.watermark == 0.2 and not custom.scheduler.full_sequence_admission
    with pytest.raises(SystemExit):  # a usage error (tests/entrypoints/test_cli_args.py)
        config("--watermark", "1.5")
    with pytest.raises(ValueError, match=r"watermark must be in \[0, 1\), got 1.5"):
        build_engine_config("unused", watermark=1.5)


@pytest.mark.parametrize("full_seq", [True, False])
def test_full_sequence_admission_waits_until_the_whole_input_fits(full_seq: bool) -> None:
    # Chunks of 8 tokens: b's first chunk fits (2 blocks), its whole 36-token prompt (9 blocks)
    # does not beside a's first 2 blocks.
    sched = make_scheduler(num_blocks=10, budget=64, threshold=8, full_seq=full_seq)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 24, max_tokens=2))
    sched.add_request(make_request("b", 36, max_tokens=2))
    out, _ = step(sched, runner)
    assert scheduled(out) == ({"a": 8} if full_seq else {"a": 8, "b": 8})
    outputs = run_to_completion(sched, runner)
    assert set(outputs) == {"a", "b"}


def test_full_sequence_admission_off_admits() -> None:
    sched = make_scheduler(num_blocks=10, full_seq=False)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, max_tokens=24))
    sched.add_request(make_request("b", 4, max_tokens=36))
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 8, "b": 4}
    run_to_completion(sched, runner)
    assert sched.num_free_blocks == 10


def test_full_sequence_admission_counts_cache_hits() -> None:
    sched = make_scheduler(num_blocks=10, full_seq=True)
    runner = FakeRunner(sched)
    prompt = list(range(16))
    sched.add_request(make_request("a", prompt, max_tokens=4))  # 4 blocks, 5 after a decode
    step(sched, runner)
    # 28 tokens = 7 blocks, 4 of them hits held by a: 3 needed, 5 free after a's decode.
    b = make_request("b", prompt + list(range(30, 42)), max_tokens=4)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 12} and b.num_cached_tokens == 16
    run_to_completion(sched, runner)
    # A hit on a free cached block saves no free blocks: it is taken out of the free queue too.
    c = make_request("c", prompt + list(range(30, 54)), max_tokens=1)  # 40 tokens = 10 blocks
    x = make_request("x", 4, max_tokens=8)
    sched.add_request(x)
    sched.add_request(c)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"x": 4} and c.status is RequestStatus.WAITING
    run_to_completion(sched, runner)
    assert c.num_cached_tokens > 0  # probe: c's prefix really was in the cache


# ---- preemption -----------------------------------------------------------------------------


def test_fcfs_victim_is_most_recently_admitted() -> None:
    sched = make_scheduler(num_blocks=6)
    runner = FakeRunner(sched)
    for name in "abc":
        sched.add_request(make_request(name, 8))
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 8, "b": 8, "c": 8} and sched.num_free_blocks == 0
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "b": 1}
    c = sched.get_request("c")
    assert c is not None and c.status is RequestStatus.PREEMPTED
    assert c.num_preemptions == 1 and c.num_computed_tokens == 0 and c.output_token_ids
    record = sched.last_step_record
    assert list(sched.waiting) == [c] and record is not None and record.kv_preempted == [c]


def test_priority_victim_is_max_priority_then_latest_arrival() -> None:
    sched = make_scheduler(num_blocks=6, policy="priority")
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 8, priority=0, arrival=1.0))
    sched.add_request(make_request("b", 8, priority=3, arrival=2.0))
    sched.add_request(make_request("c", 8, priority=1, arrival=3.0))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "c": 1}
    assert sched.get_request("b").status is RequestStatus.PREEMPTED  # type: ignore[union-attr]

    sched = make_scheduler(num_blocks=6, policy="priority")
    runner = FakeRunner(sched)
    for name, arrival in (("a", 1.0), ("b", 3.0), ("c", 2.0)):
        sched.add_request(make_request(name, 8, priority=1, arrival=arrival))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1, "c": 1}
    assert sched.get_request("b").status is RequestStatus.PREEMPTED  # type: ignore[union-attr]


def test_priority_victim_already_scheduled_this_step_gives_back_its_budget() -> None:
    sched = make_scheduler(num_blocks=4, policy="priority", budget=64)
    runner = FakeRunner(sched)
    low = make_request("low", 6, priority=5, arrival=1.0)  # 2 blocks; decodes positions 6, 7 in them
    sched.add_request(low)
    step(sched, runner)
    high = make_request("high", 8, priority=0, arrival=2.0)  # 2 blocks; its first decode needs a 3rd
    sched.add_request(high)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"low": 1, "high": 8} and sched.num_free_blocks == 0
    out, _ = step(sched, runner)
    # "low" was served first (admitted first), then chosen as the victim for "high".
    assert scheduled(out) == {"high": 1}
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    record = sched.last_step_record
    assert record is not None and "low" not in record.new_block_ids
    assert "low" not in record.prev_num_computed_tokens and record.kv_preempted == [low]
    outputs = run_to_completion(sched, runner)
    assert outputs["low"] == reference_output(low.prompt_token_ids, low.sampling_params, None, 16)


def test_self_victim_is_preempted_and_not_scheduled() -> None:
    sched = make_scheduler(num_blocks=4)
    runner = FakeRunner(sched)
    a = make_request("a", 7)  # next token fits in its 2nd block
    b = make_request("b", 8)  # next token needs a 3rd block
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == b.num_kv_preemptions == 1
    assert a.status is RequestStatus.RUNNING and a.num_preemptions == 0
    assert sched.kv_cache_manager.get_block_ids("b") == []


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make_scheduler(num_blocks=9, policy="priority")
    runner = FakeRunner(sched)
    for name in "abc":
        sched.add_request(make_request(name, 12, priority=1))  # 3 blocks each
    step(sched, runner)
    assert sched.num_free_blocks == 0
    urgent = make_request("urgent", 2, priority=0)
    sched.add_request(urgent)
    out, _ = step(sched, runner)
    # c was preempted (3 blocks), a and b took one each: one block is free and "urgent" would fit.
    assert scheduled(out) == {"a": 1, "b": 1} and sched.num_free_blocks == 1
    assert urgent.status is RequestStatus.WAITING
    out, _ = step(sched, runner)
    assert "urgent" in scheduled(out)


def test_preempted_request_resumes_with_recompute_and_same_tokens() -> None:
    sched = make_scheduler(num_blocks=8, budget=16)
    runner = FakeRunner(sched)
    reqs = [make_request(f"r{i}", 6 + i, max_tokens=12) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outputs = run_to_completion(sched, runner)
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params, None, 32)
    assert sched.num_free_blocks == 8


def test_preempted_victims_keep_fcfs_order() -> None:
    sched = make_scheduler(num_blocks=6)
    runner = FakeRunner(sched)
    a = make_request("a", 16)  # 4 blocks, each needs one more block to decode
    b, c = make_request("b", 4), make_request("c", 4)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched, runner)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"a": 1}
    assert list(sched.waiting) == [b, c]


# ---- prefix caching -------------------------------------------------------------------------


def test_prefix_cache_hits_counted_and_outputs_unchanged() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    prompt = list(range(10))
    a = make_request("a", prompt, max_tokens=3)
    sched.add_request(a)
    run_to_completion(sched, runner)
    assert a.num_cached_tokens == 0
    b = make_request("b", prompt + [7, 7], max_tokens=3)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert out.requests[0].start_pos == 8 and out.requests[0].token_ids == [8, 9, 7, 7]
    assert b.num_cached_tokens == 8
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 12, 8)
    outputs = run_to_completion(sched, runner)
    assert outputs["b"] == reference_output(b.prompt_token_ids, b.sampling_params, None, 256)


def test_a_waiting_request_is_ranked_on_what_the_prefix_cache_leaves_it() -> None:
    """A chat turn whose history is cached prefills only its new message: the monitor and the
    slack ranking see that before admission claims the blocks (monitor.policy.view_of)."""
    from monitor.policy import view_of

    sched = make_scheduler()
    runner = FakeRunner(sched)
    history = list(range(40))
    sched.add_request(make_request("turn-1", history, max_tokens=2))
    run_to_completion(sched, runner)
    turn = make_request("turn-2", history + [7, 7, 7], max_tokens=2)
    stranger = make_request("other", [9] * 43, max_tokens=2)
    for r in (turn, stranger):
        sched.add_request(r)
    assert turn.num_cached_prefix_tokens == 40 and stranger.num_cached_prefix_tokens == 0
    assert turn.num_computed_tokens == 0  # probe: still waiting, nothing claimed yet
    assert view_of(turn).remaining_prefill_tokens == 3
    assert view_of(stranger).remaining_prefill_tokens == 43
    step(sched, runner)
    assert turn.num_cached_tokens == 40  # admission found what the arrival predicted


def test_prefix_cache_never_serves_the_whole_prompt() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    prompt = list(range(8))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    b = make_request("b", prompt, max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert scheduled(out) == {"b": 4} and out.requests[0].sample
    assert b.num_cached_tokens == 4
    assert run_to_completion(sched, runner)["b"] == reference_output(prompt, b.sampling_params, None, 256)


def test_hashes_committed_only_after_update_from_output() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    prompt = list(range(12))
    a = make_request("a", prompt, max_tokens=4)
    sched.add_request(a)
    out1 = sched.schedule()
    assert all(sched.kv_cache_manager.pool.blocks[i].block_hash is None for i in out1.requests[0].block_ids)
    # b arrives while step 1 (which writes a's blocks) is still in flight; a's decode is
    # scheduled ahead of its first token.
    b = make_request("b", prompt + [1], max_tokens=4)
    sched.add_request(b)
    out2 = sched.schedule()
    assert scheduled(out2) == {"a": 1, "b": 13} and b.num_cached_tokens == 0
    assert sched.prefix_cache_hits == 0
    sched.update_from_output(out1, runner.execute(out1))
    sched.check_invariants()
    pool = sched.kv_cache_manager.pool
    assert all(pool.blocks[i].block_hash is not None for i in out1.requests[0].block_ids)
    sched.update_from_output(out2, runner.execute(out2))
    # b computed the same blocks; the first commit won, b's copies stay private.
    (b_step,) = [r for r in out2.requests if r.req_id == "b"]
    assert all(pool.blocks[i].block_hash is None for i in b_step.block_ids)
    c = make_request("c", prompt + [2], max_tokens=4)
    sched.add_request(c)
    out3, _ = step(sched, runner)
    assert c.num_cached_tokens == 12 and sched.prefix_cache_hits == 12
    sched.check_invariants()
    outputs = run_to_completion(sched, runner)
    for r in (a, b, c):
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.sampling_params, None, 256)


def test_commit_uses_the_step_extent_not_the_advanced_counter() -> None:
    sched = make_scheduler(budget=4)
    runner = FakeRunner(sched)
    a = make_request("a", list(range(10)))
    sched.add_request(a)
    out1 = sched.schedule()  # positions 0..3
    out2 = sched.schedule()  # positions 4..7, in flight
    sched.update_from_output(out1, runner.execute(out1))
    blocks = [sched.kv_cache_manager.pool.blocks[i] for i in sched.kv_cache_manager.get_block_ids("a")]
    assert [b.block_hash is not None for b in blocks] == [True, False]
    sched.update_from_output(out2, runner.execute(out2))
    assert [b.block_hash is not None for b in blocks] == [True, True]
    sched.check_invariants()


def test_preempted_request_reuses_its_own_cached_prefix() -> None:
    sched = make_scheduler(num_blocks=10, budget=64)
    runner = FakeRunner(sched)
    a = make_request("a", 11)  # 3 blocks, next token fits
    b = make_request("b", 24)  # 6 blocks, next token needs a 7th
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)
    c = make_request("c", 3)
    sched.add_request(c)
    step(sched, runner)  # c takes the last block
    out, _ = step(sched, runner)
    assert b.status is RequestStatus.PREEMPTED
    hits = sched.prefix_cache_hits
    while b.status is not RequestStatus.RUNNING:
        step(sched, runner)
    assert sched.prefix_cache_hits - hits >= 20  # its 6 committed blocks (minus the last token)
    run_to_completion(sched, runner)


# ---- stop checks, aborts, bad input ---------------------------------------------------------


def test_stop_on_eos_stop_token_and_lengths() -> None:
    prompt = [1, 2, 3]
    first = next_token(prompt)
    sched = make_scheduler(num_blocks=8, max_model_len=8)
    runner = FakeRunner(sched)
    eos = make_request("eos", prompt, max_tokens=5, eos=first)
    ign = make_request("ign", prompt, max_tokens=2, eos=first, ignore_eos=True)
    stop = make_request("stop", prompt, max_tokens=5, stop_token_ids=[first])
    mml = make_request("mml", prompt, max_tokens=100)
    for r in (eos, ign, stop, mml):
        sched.add_request(r)
    run_to_completion(sched, runner)
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert eos.output_token_ids == [first]
    assert ign.status is RequestStatus.FINISHED_LENGTH and ign.num_output_tokens == 2
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == first
    assert mml.status is RequestStatus.FINISHED_LENGTH and mml.num_tokens == 8
    assert all(r.finish_time is not None for r in (eos, ign, stop, mml))


def test_update_returns_sampled_requests_in_scheduling_order() -> None:
    sched = make_scheduler(budget=10)
    runner = FakeRunner(sched)
    for name, n in (("a", 3), ("b", 5), ("c", 6)):
        sched.add_request(make_request(name, n, max_tokens=1 if name == "a" else 4))
    out, got = step(sched, runner)
    assert [r.request_id for r in got] == ["a", "b"]  # c was only partly prefilled
    assert got[0].is_finished


def test_abort_frees_everything_and_ignores_unknown_ids() -> None:
    sched = make_scheduler(num_blocks=16, budget=8)
    runner = FakeRunner(sched)
    for name in "abcd":
        sched.add_request(make_request(name, 10, max_tokens=20))
    step(sched, runner)
    assert sched.num_running == 1 and sched.num_waiting == 3
    aborted = sched.abort_requests(["a", "c", "nope"])
    assert [r.request_id for r in aborted] == ["a", "c"]
    assert all(r.status is RequestStatus.FINISHED_ABORTED and r.finish_time for r in aborted)
    assert sched.get_request("a") is None
    sched.check_invariants()
    step(sched, runner)
    sched.abort_requests(["b", "d"])
    sched.check_invariants()
    assert not sched.has_unfinished_requests() and sched.num_free_blocks == 16


def test_abort_between_schedule_and_update() -> None:
    sched = make_scheduler()
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5, max_tokens=1))
    out = sched.schedule()
    result = runner.execute(out)
    sched.abort_requests(["a"])
    got = sched.update_from_output(out, result)
    assert [r.request_id for r in got] == ["b"]
    sched.check_invariants()
    assert sched.num_free_blocks == 64


def test_bad_input_is_refused_and_changes_nothing() -> None:
    sched = make_scheduler(num_blocks=8, max_model_len=16)
    runner = FakeRunner(sched)
    sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 17))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("empty", []))
    out = sched.schedule()
    good = runner.execute(out)
    with pytest.raises(ValueError, match="no sampled token"):
        sched.update_from_output(out, ModelRunnerOutput(step_id=out.step_id))
    with pytest.raises(ValueError, match="step"):
        sched.update_from_output(out, ModelRunnerOutput(step_id=out.step_id + 1))
    with pytest.raises(ValueError, match="roll it back"):
        sched.update_from_output(out, ModelRunnerOutput(step_id=out.step_id, status=StepStatus.ERROR))
    a = sched.get_request("a")
    assert a is not None and a.output_token_ids == []
    sched.update_from_output(out, good)
    assert a.num_output_tokens == 1
    sched.check_invariants()


def test_startup_refuses_max_model_len_larger_than_pool() -> None:
    make_scheduler(num_blocks=4, max_model_len=16)
    with pytest.raises(ValueError, match=r"max_model_len=17 needs 5 KV blocks.*only 4 blocks"):
        make_scheduler(num_blocks=4, max_model_len=17)


# ---- queues ---------------------------------------------------------------------------------


def test_priority_queue_order_and_prepend() -> None:
    q = create_request_queue("priority")
    assert isinstance(q, PriorityQueue)
    a = make_request("a", 1, priority=1, arrival=1.0)
    b = make_request("b", 1, priority=0, arrival=2.0)
    c = make_request("c", 1, priority=1, arrival=1.0)
    d = make_request("d", 1, priority=1, arrival=1.0)
    for r in (a, b, c):
        q.add(r)
    q.prepend(d)  # ties with a and c, goes first among them
    assert [r.request_id for r in q] == ["b", "d", "a", "c"]
    q.remove(a)
    assert q.peek() is b and len(q) == 3
    assert [q.pop().request_id for _ in range(3)] == ["b", "d", "c"]
    assert not q
    with pytest.raises(IndexError):
        q.pop()


def test_fcfs_queue_and_factory() -> None:
    q = create_request_queue("fcfs")
    assert isinstance(q, FCFSQueue)
    a, b, c = (make_request(n, 1) for n in "abc")
    q.add(a)
    q.add(b)
    q.prepend(c)
    assert list(q) == [c, a, b] and a in q
    q.remove(a)
    assert q.pop() is c and q.peek() is b
    with pytest.raises(ValueError):
        create_request_queue("lifo")


# ---- randomized stress ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_random_stress(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = rng.randint(6, 14)
    max_model_len = num_blocks * BS - rng.randint(0, 3)
    chunked = rng.random() < 0.75
    budget = rng.randint(max_model_len if not chunked else 1, max_model_len + 20)
    sched = make_scheduler(
        num_blocks,
        max_model_len,
        budget=budget,
        max_num_seqs=rng.randint(1, 6),
        threshold=rng.choice([0, 0, 3, 7]),
        chunked=chunked,
        policy=rng.choice(["fcfs", "priority"]),
        full_seq=rng.random() < 0.5,
        watermark=rng.choice([0.0, 0.1, 0.25]),
        prefix=rng.random() < 0.8,
    )
    runner = FakeRunner(sched)
    shared_prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    pending: list[Request] = []
    for i in range(40):
        prompt = rng.choice(shared_prefixes)[:] if rng.random() < 0.5 else []
        prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 16))]
        prompt = prompt[: max_model_len - 1]
        pending.append(
            make_request(
                f"r{i}",
                prompt,
                max_tokens=rng.randint(1, 24),
                priority=rng.randint(0, 3),
                eos=rng.choice([None, rng.randrange(VOCAB)]),
            )
        )
    all_reqs = list(pending)
    aborted: set[str] = set()
    outputs: dict[str, list[int]] = {}
    max_steps = 5_000
    for _ in range(max_steps):
        if not pending and not sched.has_unfinished_requests():
            break
        for _ in range(rng.randint(0, 2)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            victim = rng.choice(list(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        sched.check_invariants()
        out, got = step(sched, runner)
        assert out.num_scheduled_tokens <= budget
        assert len(out.requests) <= sched.config.max_num_seqs
        for r in got:
            if r.is_finished:
                outputs[r.request_id] = list(r.output_token_ids)
    else:
        raise AssertionError(f"livelock: work left after {max_steps} steps")

    assert sched.num_free_blocks == num_blocks
    sched.check_invariants()
    for r in all_reqs:
        if r.request_id in aborted:
            assert r.status is RequestStatus.FINISHED_ABORTED
            continue
        expected = reference_output(r.prompt_token_ids, r.sampling_params, r.eos_token_id, max_model_len)
        assert outputs[r.request_id] == expected, r.request_id
