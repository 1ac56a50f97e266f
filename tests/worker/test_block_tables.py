"""The workers' block tables (workers/block_tables.py) and the updates the scheduler sends them
(engine/core/kv_cache_manager.py ``table_update``): only what changed of a table crosses to the
workers, and after rollbacks, preemptions and finishes the tables they hold are the scheduler's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.scheduler_output import ScheduledRequest
from engine.sampling_params import SamplingParams
from tests.utils.scheduling import BS, FakeRunner, make_request, make_scheduler, step
from workers.block_tables import BlockTables

GREEDY = SamplingParams(temperature=0)


def _update(req_id: str, start: int, ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req_id=req_id, token_ids=[1], start_pos=0, block_ids=ids,
                            block_table_start=start, sample=False, sampling_params=GREEDY)


def test_tables_grow_by_updates_and_gather_in_step_order() -> None:
    tables = BlockTables(max_blocks=2, rows=1)
    tables.update(_update("a", 0, [5, 6]))
    tables.update(_update("b", 0, [9]))  # a second row: the table grows
    tables.update(_update("a", 2, [7, 8, 10]))  # past the columns: they grow too
    gathered, widths = tables.gather([_update("b", 1, []), _update("a", 5, [])])
    assert widths.tolist() == [1, 5]
    assert gathered.tolist() == [[9, 0, 0, 0, 0], [5, 6, 7, 8, 10]]
    padded, _ = tables.gather([_update("b", 1, [])], width=3)
    assert padded.tolist() == [[9, 0, 0]]


def test_an_update_from_inside_the_table_replaces_its_tail() -> None:
    """A rolled-back step's blocks went back to the pool: the next update starts below them and
    nothing of the old tail shows, even where the gather pads a shorter row."""
    tables = BlockTables(max_blocks=4)
    tables.update(_update("a", 0, [1, 2, 3, 4]))
    gathered, widths = tables.gather([_update("a", 2, [7])])
    assert widths.tolist() == [3] and gathered.tolist() == [[1, 2, 7]]
    gathered, _ = tables.gather([_update("a", 3, []), _update("b", 0, [3, 3, 3, 3])])
    assert gathered.tolist() == [[1, 2, 7, 0], [3, 3, 3, 3]]


def test_released_rows_are_reused_and_updates_past_the_table_are_refused() -> None:
    tables = BlockTables(max_blocks=4, rows=1)
    row = tables.update(_update("a", 0, [1]))
    tables.release(["a", "never-seen"])
    assert tables.update(_update("b", 0, [2])) == row and "a" not in tables.row_of
    with pytest.raises(ValueError, match="no earlier blocks were sent"):
        tables.update(_update("a", 1, [3]))
    with pytest.raises(ValueError, match="only 1 blocks are held"):
        tables.update(_update("b", 2, [3]))


def test_decode_steps_send_a_block_id_only_when_a_block_starts() -> None:
    """The scheduler's side, against the FakeRunner, whose KV reads and writes go through the
    tables it rebuilt from the updates (a wrong update changes the output)."""
    sched = make_scheduler(budget=64)
    runner = FakeRunner(sched)
    request = make_request("a", 20, max_tokens=30)
    sched.add_request(request)
    out, _ = step(sched, runner)
    (first,) = out.requests
    assert first.block_table_start == 0 and len(first.block_ids) == -(-20 // BS)
    sent = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        if out.requests:
            (r,) = out.requests
            sent.append((r.start_pos, r.block_table_start, r.block_ids))
    # A decode at position p writes block p // BS: an id is sent only when that block starts.
    assert len(sent) == 29
    for position, start, ids in sent:
        assert start == -(-position // BS)
        assert len(ids) == (1 if position % BS == 0 else 0)
    assert request.output_token_ids == runner_output(request)
    # Finished: its blocks are free, and the next step the workers are sent releases its table.
    out = sched.schedule()
    assert out.released_req_ids == ["a"]
    runner.execute(out)
    assert "a" not in runner.tables.row_of


def runner_output(request) -> list[int]:
    from tests.utils.scheduling import reference_output

    return reference_output(request.prompt_token_ids, request.sampling_params, None, 256)


def test_a_kv_preempted_request_is_released_and_sent_whole_again() -> None:
    """Preempted for KV space: its blocks are freed, so the workers drop its table and the
    re-admission sends the whole new one; outputs stay the reference's."""
    sched = make_scheduler(budget=64, num_blocks=24)
    runner = FakeRunner(sched)
    a, b = make_request("a", 30, max_tokens=40), make_request("b", 30, max_tokens=40)
    sched.add_request(a)
    sched.add_request(b)
    released: list[str] = []
    restarts = 0
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        released += out.released_req_ids
        restarts += sum(r.block_table_start == 0 and r.start_pos > 0 for r in out.requests)
    assert a.num_preemptions + b.num_preemptions > 0  # probe: KV preemption really happened
    assert restarts > 0 and set(released) & {"a", "b"}
    assert a.output_token_ids == runner_output(a) and b.output_token_ids == runner_output(b)


def test_gathered_tables_are_copies() -> None:
    tables = BlockTables(max_blocks=2)
    tables.update(_update("a", 0, [4, 5]))
    gathered, _ = tables.gather([_update("a", 2, [])])
    gathered[0, 0] = 99
    assert np.array_equal(tables.gather([_update("a", 2, [])])[0], [[4, 5]])
