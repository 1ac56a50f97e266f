"""engine.serving.intake_turns: a flood's intake in slices of the event loop, the earliest
deadline first, with the wake-ups posted meanwhile run between the slices."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.serving.intake_turns import IntakeTurns

INTAKE_S = 0.001  # each request's intake: a millisecond of the loop's time, held


def hold_loop(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def flood(turns: IntakeTurns | None, count: int) -> tuple[list[int], int]:
    """`count` requests ready at once, each taking its turn (none: straight in) and then
    INTAKE_S of the loop; the first posts a wake-up for the next iteration (as a replica's
    first token for an accepted stream is posted). Returns the order the intakes ran in and
    how many had run when the wake-up did."""
    order: list[int] = []
    woke_after: list[int] = []
    loop = asyncio.get_running_loop()

    async def request(i: int) -> None:
        if turns is not None:
            await turns.turn()
        if i == 0:
            loop.call_soon(lambda: woke_after.append(len(order)))
        hold_loop(INTAKE_S)
        order.append(i)

    await asyncio.gather(*(request(i) for i in range(count)))
    return order, woke_after[0]


def test_a_wake_up_waits_for_one_slice_of_a_flood_not_all_of_it():
    turns = IntakeTurns(slice_s=0.004)
    order, woke_after = asyncio.run(flood(turns, 40))
    assert order == list(range(40))  # arrival order
    # A slice holds at most slice_s / INTAKE_S intakes and the one that crosses it.
    assert 1 <= woke_after <= 5
    assert turns.slices >= 8 and len(turns) == 0
    assert turns.cost_s >= INTAKE_S * 0.9  # measured: the slices' time over their intakes
    # Probe: straight in, every intake is one step of the same iteration, and the wake-up
    # waits for all of them.
    order, woke_after = asyncio.run(flood(None, 40))
    assert woke_after == 40


def test_turns_go_by_deadline_and_by_arrival_among_equals():
    async def main() -> list[str]:
        turns = IntakeTurns(slice_s=0.002)
        order: list[str] = []

        async def request(name: str, deadline: float | None) -> None:
            await turns.turn(deadline)
            # The first spends a slice and more: the rest wait for their turns.
            hold_loop(0.003 if not order else INTAKE_S)
            order.append(name)

        # As a flood arrives: documents with far deadlines, urgent turns, no objective. The
        # first takes the open slice at once, whatever its deadline.
        arrivals = [("doc0", 15.0), ("turn0", 0.3), ("none0", None), ("doc1", 12.0),
                    ("turn1", 0.15), ("turn2", 0.3), ("none1", None), ("doc2", 12.0)]
        arrivals += [(f"late{i}", 20.0) for i in range(12)]
        await asyncio.gather(*(request(n, d) for n, d in arrivals))
        return order

    order = asyncio.run(main())
    assert order[0] == "doc0"
    # The rest, though slices end and woken requests find them spent, by deadline.
    assert order[1:] == (["turn1", "turn0", "turn2", "doc1", "doc2"]
                         + [f"late{i}" for i in range(12)] + ["none0", "none1"])


def test_a_long_first_iteration_does_not_leave_one_intake_per_slice():
    """The iteration that opens a flood's first slice also runs the first steps of every
    request that arrived with it; the slices after it still take in as many intakes as fit."""
    async def main() -> tuple[IntakeTurns, float]:
        turns = IntakeTurns(slice_s=0.004)
        loop = asyncio.get_running_loop()

        async def request() -> None:
            await turns.turn()
            hold_loop(INTAKE_S)

        began = time.perf_counter()
        # In one iteration: the first request takes its turn, 100 ms of other steps run, and
        # 20 more requests find the slice spent.
        first = asyncio.create_task(request())
        loop.call_soon(hold_loop, 0.1)
        rest = [asyncio.create_task(request()) for _ in range(20)]
        await asyncio.gather(first, *rest)
        return turns, time.perf_counter() - began

    turns, took = asyncio.run(main())
    assert took >= 0.1  # probe: the loop really was held
    # 20 intakes of 1 ms after it, in slices of 4 ms: about 5 slices, not one per intake
    # while an estimate taken from the first slice's span (100 ms) wears off.
    assert turns.slices <= 9, turns.slices
    assert turns.cost_s < 0.004


def test_a_lone_request_takes_its_turn_without_waiting_for_an_iteration():
    async def lone() -> tuple[bool, bool]:
        turns = IntakeTurns()
        ran = []
        asyncio.get_running_loop().call_soon(ran.append, True)
        await turns.turn()
        before = bool(ran)
        await asyncio.sleep(0)
        return before, bool(ran)

    # Probe of the probe: the callback does run once the loop turns.
    assert asyncio.run(lone()) == (False, True)


def test_a_request_that_goes_away_gives_its_turn_to_the_next():
    async def main(cancel_granted: bool) -> tuple[list[str], int]:
        turns = IntakeTurns(slice_s=0.002)
        order: list[str] = []

        async def request(name: str) -> None:
            await turns.turn()
            hold_loop(0.003)  # longer than a slice: one intake per slice
            order.append(name)

        tasks = {n: asyncio.create_task(request(n)) for n in ("first", "gone", "next", "last")}
        await asyncio.sleep(0)  # "first" takes the slice; the others wait for their turns
        assert len(turns) == 3
        if cancel_granted:
            while not turns._woken:  # "gone" has its turn and has not yet taken it
                await asyncio.sleep(0)
        tasks["gone"].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return order, len(turns) + turns._woken

    # Gone while it waited, or after its turn was granted: the rest are taken in, in order.
    assert asyncio.run(main(cancel_granted=False)) == (["first", "next", "last"], 0)
    assert asyncio.run(main(cancel_granted=True)) == (["first", "next", "last"], 0)


def test_the_slice_must_be_positive():
    with pytest.raises(ValueError, match="slice_s must be positive"):
        IntakeTurns(slice_s=0)
