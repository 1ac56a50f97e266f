"""DueFirstOutputs: which owed first outputs hold back a long input's tokenization, and for how
long; and the lanes' long input waiting on them while a short one does not."""

from __future__ import annotations

import asyncio
import threading
import time

from engine.serving.due_first_outputs import DueFirstOutputs
from engine.serving.tokenize_lanes import INLINE_INPUT_CHARS, LONG_INPUT_CHARS, TokenizeLanes


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_only_earlier_deadlines_inside_the_horizon_hold_back():
    clock = _Clock()
    due = DueFirstOutputs(clock, horizon_s=1.0)
    due.due("turn", clock.now + 0.2)
    due.due("other document", clock.now + 12.0)
    due.due("no objective", None)  # nothing owed by a time: not recorded
    assert len(due) == 2
    assert due.holding_back(clock.now + 10.0) == 1  # the turn; not the far document
    assert due.holding_back(None) == 1  # no deadline of its own: as if infinitely far
    assert due.holding_back(clock.now + 0.1) == 0  # its own comes first
    due.out("turn")
    due.out("turn")  # idempotent
    assert due.holding_back(clock.now + 10.0) == 0
    clock.now += 11.5  # the other document's deadline is inside the horizon now
    assert due.holding_back(None) == 1


def test_a_pause_between_pieces_holds_the_lanes_thread_until_the_first_output():
    """On the lane's thread: held while an earlier first output is owed, released by it; the
    wait before the lane and the pauses share one allowance."""
    due = DueFirstOutputs(max_defer_s=60.0)
    deferral = due.deferral(time.time() + 10)
    assert deferral.pause() < 0.05  # nothing owed: no pause
    due.due("turn", time.time() + 0.5)
    paused = threading.Thread(target=deferral.pause)
    paused.start()
    paused.join(0.2)
    assert paused.is_alive()  # probe: the thread is held
    due.out("turn")
    paused.join(5)
    assert not paused.is_alive() and deferral.waited_s >= 0.2

    due.max_defer_s = 0.3
    short = due.deferral(time.time() + 10)
    due.due("stuck", time.time() + 0.5)  # never out
    began = time.time()
    asyncio.run(short.wait())
    short.pause()
    assert 0.3 <= time.time() - began < 5  # the allowance is spent once, not once per wait
    assert len(due) == 1


def test_the_wait_ends_at_the_first_output_or_after_the_longest_deferral():
    async def run():
        due = DueFirstOutputs(max_defer_s=60.0)  # only a first output ends these waits
        await asyncio.wait_for(due.wait_for_earlier(None), 5.0)  # nothing owed: no wait

        due.due("turn", time.time() + 0.5)
        waiter = asyncio.create_task(due.wait_for_earlier(time.time() + 10))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # probe: it is waiting
        due.out("turn")
        await asyncio.wait_for(waiter, 5.0)

        due.max_defer_s = 0.3
        due.due("stuck", time.time() + 0.5)  # never out
        waited = await asyncio.wait_for(due.wait_for_earlier(time.time() + 10), 5.0)
        assert waited >= 0.3
        assert len(due) == 1  # still owed: the wait gave up, the record stays

    asyncio.run(run())


class NamedInputs(str):
    """A stand-in for an InputProcessor: its name says which lane's it is."""

    def holding_gil(self) -> NamedInputs:
        return NamedInputs(f"{self}, holding the GIL")

    def between_pieces(self, between) -> NamedInputs:
        pieced = NamedInputs(f"{self}, in pieces")
        pieced.between = between
        return pieced


def test_a_long_input_waits_on_its_lane_and_a_short_one_does_not():
    async def run():
        due = DueFirstOutputs(max_defer_s=30.0)
        lanes = TokenizeLanes(NamedInputs("short inputs"), lambda: NamedInputs("long inputs"),
                              due)
        try:
            due.due("turn", time.time() + 0.2)
            started: dict[str, float] = {}

            def work(name):
                def run_it(inputs):
                    started[name] = time.time()
                    return inputs, threading.current_thread().name
                return run_it

            document = asyncio.create_task(lanes.on_lane(LONG_INPUT_CHARS, work("document"),
                                                         time.time() + 10))
            middling = await asyncio.wait_for(
                lanes.on_lane(INLINE_INPUT_CHARS, work("middling")), 5)
            assert middling[0] == "short inputs"  # the short lane took it at once
            await asyncio.sleep(0.1)
            assert "document" not in started and not document.done()  # probe: held back
            released = time.time()
            due.out("turn")
            inputs, thread = await asyncio.wait_for(document, 5)
            assert inputs == "long inputs, in pieces"
            assert thread.startswith("sloserve-tokenize-long")
            assert started["document"] >= released
        finally:
            lanes.shutdown()

    asyncio.run(run())


def test_a_long_input_pauses_between_its_pieces_for_a_turn_owed_after_it_began():
    """A turn that arrives while a document is being encoded: the lane stops at the next seam
    until the turn's first output is out."""
    async def run():
        due = DueFirstOutputs(max_defer_s=30.0)
        lanes = TokenizeLanes(NamedInputs("short inputs"), lambda: NamedInputs("long inputs"),
                              due)
        first_piece = threading.Event()
        resumed: list[float] = []

        def encode(inputs):
            first_piece.set()
            time.sleep(0.1)  # the first piece; the turn arrives meanwhile
            inputs.between()
            resumed.append(time.time())
            return "ids"

        try:
            document = asyncio.create_task(lanes.on_lane(LONG_INPUT_CHARS, encode,
                                                         time.time() + 10))
            while not first_piece.is_set():
                await asyncio.sleep(0.005)
            due.due("turn", time.time() + 0.2)
            await asyncio.sleep(0.4)
            assert not resumed and not document.done()  # probe: paused at the seam
            released = time.time()
            due.out("turn")
            assert await asyncio.wait_for(document, 5) == "ids"
            assert resumed[0] >= released
        finally:
            lanes.shutdown()

    asyncio.run(run())
