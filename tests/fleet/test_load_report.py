"""A replica's load report (engine.load.load_report.ReplicaLoad) as EngineCore builds it: from
the state the engine thread publishes, so that it can be taken on another thread while a long
step runs; and over the IPC channel, from the API server's AsyncEngineClient."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.config import build_engine_config
from engine.core.block_pool import BlockPool
from engine.load.load_report import ReplicaLoad, decode_load, encode_load
from engine.load.prefix_hashes import cached_prefix_blocks, prompt_prefix_hashes
from engine.ipc.async_client import AsyncEngineClient
from engine.sampling_params import SamplingParams
from tests.utils.mid_forward import LONG_PROMPT, _engine, _on_long_step, _prompt, _request, _run

H100 = "h100-llama-3.1-8b"


def test_the_pool_keeps_the_hashes_of_its_cached_blocks_newest_last():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    hashes = [bytes([i]) * 32 for i in (1, 2, 3)]
    for block, h in zip(blocks, hashes):
        assert pool.commit_hash(block, h)
    assert pool.newest_hashes(10) == hashes
    assert pool.newest_hashes(2) == hashes[1:]
    pool.free(blocks)
    pool.touch([blocks[0]])  # a prefix-cache hit: reused, so the newest
    assert pool.newest_hashes(10) == [hashes[1], hashes[2], hashes[0]]
    pool.allocate(3)  # evicts the other two cached blocks (and the uncached fourth)
    assert pool.newest_hashes(10) == [hashes[0]]
    pool.check_invariants()


def test_a_waiting_request_is_reported_with_its_deadline_without_slo_preemption(model):
    """With SLO preemption off there is no monitor: the engine keeps the snapshot itself."""
    engine = _engine(model, slo_preemption=False, max_num_seqs=1)
    try:
        assert engine.slo_preemption is None
        idle = engine.load_report()
        assert idle.waiting == idle.running == [] and idle.num_requests == 0
        assert idle.step_remaining_s == 0 and not idle.slo_preemption
        assert idle.num_free_blocks == idle.num_blocks == 160 and idle.block_size == 16
        # Handed over but not yet scheduled: the router must see it at once.
        first = _request("first", _prompt(40, seed=1), slo_ms=None)
        engine.submit_request(first)
        arrived = engine.load_report()
        assert [(q.remaining_prefill_tokens, q.time_to_deadline_s) for q in arrived.waiting] == [
            (40, None)]
        engine.step()  # admits `first` (max_num_seqs=1)
        second = _request("second", _prompt(30, seed=2), slo_ms=60_000)
        engine.submit_request(second)
        engine.step()  # `second` waits behind it
        before = time.monotonic()
        load = engine.load_report()
        after = time.monotonic()
        assert len(load.waiting) == 1 and load.running == []
        waiter = load.waiting[0]
        assert waiter.remaining_prefill_tokens == 30 and waiter.slo_s == pytest.approx(60)
        # Relative to the moment the report was made.
        assert second.deadline - after <= waiter.time_to_deadline_s <= second.deadline - before
        assert 0 < waiter.time_to_deadline_s < 60
        assert load.num_decoding == 1 and load.decode_context > 0 and load.num_requests == 2
        assert load.num_free_blocks < load.num_blocks
        assert abs(load.made_at - time.time()) < 5  # wall clock, not monotonic
        _run(engine)
        done = engine.load_report()
        assert done.num_requests == 0 and done.waiting == done.running == []
        assert done.num_decoding == 0 and done.step_remaining_s == 0
    finally:
        engine.shutdown()


def test_a_report_during_a_long_step_shows_its_prefill_and_time_left(model):
    engine = _engine(model)
    try:
        reports: list[ReplicaLoad] = []
        prompt = _prompt(LONG_PROMPT, seed=3)
        # Taken on another thread at the long step's 3rd layer (of 8), while the engine
        # thread is inside the forward pass.
        _on_long_step(engine, 3, lambda: reports.append(engine.load_report()))
        engine.add_request(_request("long", prompt, slo_ms=60_000))
        _run(engine)
        assert len(reports) == 1, reports
        during = reports[0]
        assert during.step_remaining_s > 0 and during.step_preemptible
        assert [q.remaining_prefill_tokens for q in during.running] == [LONG_PROMPT]
        assert during.running[0].time_to_deadline_s == pytest.approx(60, abs=5)
        assert during.slo_preemption and during.preempt_margin == pytest.approx(1.2)
        assert during.num_requests == 1 and during.waiting == []
        assert during.step_model.seconds_per_token > 0
        assert decode_load(encode_load(during)) == during  # what travels to the router

        # Its prompt's full blocks are now cached, in chain order.
        after = engine.load_report()
        expected = prompt_prefix_hashes(prompt, 16)
        assert len(expected) == LONG_PROMPT // 16
        assert after.cached_prefix_hashes[:len(expected)] == expected
        assert cached_prefix_blocks(expected, after.cached_prefix_hashes) == len(expected)
        assert after.step_remaining_s == 0 and after.running == []
        assert after.num_free_blocks == after.num_blocks  # cached blocks count as free
    finally:
        engine.shutdown()


def test_the_simulated_engine_reports_its_load_over_ipc(sim_model):
    """`--simulate h100-llama-3.1-8b` (what the fleet benchmark's replicas run): the API
    server's client asks the EngineCore process for a report while a ~1.2 s simulated
    prefill runs; the reader thread answers during the step."""
    config = build_engine_config(sim_model, simulate=H100, max_model_len=32768,
                                 max_num_batched_tokens=32768)

    async def scenario() -> tuple[ReplicaLoad, ReplicaLoad, ReplicaLoad, float]:
        client = AsyncEngineClient(config)
        await client.start()
        try:
            idle = await client.load_report()

            async def consume() -> None:
                params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
                async for _ in client.generate("long", None, [7] * 24_000, params,
                                               arrival_time=time.monotonic(),
                                               ttft_slo_ms=60_000):
                    pass

            task = asyncio.create_task(consume())
            sent = time.monotonic()
            during = None
            for _ in range(200):
                await asyncio.sleep(0.02)
                # Concurrent askers share one query.
                first, second = await asyncio.gather(client.load_report(),
                                                     client.load_report())
                assert first is second
                # A few of its layers in (37 ms each), so that the step's measured pace is
                # in the report, not only the seed's prediction (the suite's short startup
                # calibration times two sizes at the simulated launch floor, whose line says
                # a 24k-token step takes 32 ms).
                if first.running and time.monotonic() - sent > 0.25:
                    during = first
                    break
            assert during is not None
            answered = time.monotonic()
            await task
            return idle, during, await client.load_report(), answered
        finally:
            await client.shutdown()

    idle, during, after, _ = asyncio.run(scenario())
    assert idle.num_requests == 0 and idle.num_blocks > 0
    assert [q.remaining_prefill_tokens for q in during.running] == [24_000]
    # The measured pace only ever lengthens the predicted step (whatever the seed predicts).
    assert during.step_remaining_s > 0.1 and during.step_preemptible
    assert during.step_model.seconds_per_token > 0
    assert after.num_requests == 0 and after.cached_prefix_hashes[:4] == (
        prompt_prefix_hashes([7] * 24_000, after.block_size, max_blocks=4))
