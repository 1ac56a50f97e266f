"""The fleet's ingress without Ray's actors: a fake engine handle stands for the replicas
(tests/utils/fleet_ingress.py), so the retry, mid-stream failure, API key, route hint and
admission paths run deterministically."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

# Ray Serve comes with the cluster extra, which the README's test command installs.
pytest.importorskip("ray.serve", reason="the fleet's tests need Ray Serve: pip install -e "
                                        "'.[test,cluster]'")
from engine.fleet import book_registry
from engine.fleet.asgi_bridge import ResponseStart
from engine.fleet.fleet_metrics import carries_output
from engine.fleet.ingress import INVALID_BODY, Unhinted
from engine.fleet.routing import FleetBook
from tests.fleet.builders import load
from tests.utils.fleet_ingress import DEPLOYMENT, FakeStream
from tests.utils.fleet_ingress import call as _call
from tests.utils.fleet_ingress import start_ingress as _ingress

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _sse(*events: dict | str) -> list[bytes]:
    return [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events]


def test_a_replica_that_dies_before_answering_is_retried_on_another(tiny_model):
    async def run():
        good = FakeStream([ResponseStart(status=200, headers=[(b"content-type",
                                                               b"application/json")]),
                           b'{"ok": true}'])
        ingress = await _ingress(tiny_model(), [FakeStream([], fail_at=0), good])
        response = await _call(ingress, "POST", "/v1/completions",
                               {"model": "m", "prompt": "hello there", "max_tokens": 2})
        assert response.status_code == 200 and response.json() == {"ok": True}
        assert len(ingress.engine.calls) == 2  # the same request, tried twice
        assert ingress.engine.calls[0][1] == ingress.engine.calls[1][1]
        assert "sloserve:fleet_retries_total 1.0" in ingress.metrics.response().body.decode()

    asyncio.run(run())


def test_no_replica_left_is_a_clear_503(tiny_model):
    async def run():
        ingress = await _ingress(tiny_model(), [FakeStream([], fail_at=0) for _ in range(3)])
        response = await _call(ingress, "POST", "/v1/completions",
                               {"model": "m", "prompt": "x", "max_tokens": 2})
        assert response.status_code == 503
        assert "no replica could take the request" in response.json()["error"]["message"]

    asyncio.run(run())


def _full(replica: str, reason: str = "max_num_queued_reqs") -> FakeStream:
    """A replica's 429 at its queue bound, as the single server answers it."""
    body = json.dumps({"error": {"message": f"over its bound of 8 (--{reason.replace('_', '-')})",
                                 "type": "RateLimitError", "code": 429}}).encode()
    return FakeStream([ResponseStart(status=429, headers=[
        (b"content-type", b"application/json"), (b"retry-after", b"1"),
        (b"x-sloserve-rejected", reason.encode()), (b"x-sloserve-replica", replica.encode())]),
        body])


def test_a_replica_at_its_queue_bound_has_the_request_tried_on_another(tiny_model):
    """A replica's 429 at its queue bound goes to another replica that has not refused it,
    and the router ranks the refusing one last; when every replica refused, the client gets
    the 429, counted at the fleet's edge by its reason."""
    async def run():
        book = FleetBook(seed=0)
        for rid in ("r1", "r2"):
            book.on_report(rid, load(made_at=time.time()))
        book_registry.register(DEPLOYMENT, book)
        first, served = _full("r1"), FakeStream([
            ResponseStart(status=200, headers=[(b"content-type", b"application/json"),
                                               (b"x-sloserve-replica", b"r2")]), b'{"ok": 1}'])
        ingress = await _ingress(tiny_model(), [first, served, _full("r2"), _full("r1")])
        body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
        moved = await _call(ingress, "POST", "/v1/completions", body)
        assert moved.status_code == 200 and moved.json() == {"ok": 1}
        assert first.cancelled and not book.has_room("r1") and book.has_room("r2")
        assert len(ingress.engine.calls) == 2
        # Both replicas refuse the next one: its 429 reaches the client, named and counted.
        refused = await _call(ingress, "POST", "/v1/completions", body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.headers["x-sloserve-rejected"] == "max_num_queued_reqs"
        assert "--max-num-queued-reqs" in refused.json()["error"]["message"]
        assert len(ingress.engine.calls) == 4
        page = ingress.metrics.response().body.decode()
        assert 'sloserve:fleet_rerouted_total{reason="max_num_queued_reqs"} 2.0' in page
        assert 'sloserve:fleet_rejected_total{reason="max_num_queued_reqs"} 1.0' in page

    try:
        asyncio.run(run())
    finally:
        book_registry._BOOKS.pop(DEPLOYMENT, None)


def test_a_full_fleet_refuses_before_computing_the_hint(tiny_model):
    """Every replica at its queue bound as the router counts them: a generation request gets
    the queue bound's 429 at the ingress, its hint never computed and no replica called. The
    probe: with one place left, the same request is hinted and forwarded."""
    import msgspec

    async def run():
        book = FleetBook(seed=0)
        book_registry.register(DEPLOYMENT, book)

        def report(rid: str, held: int) -> None:
            book.on_report(rid, msgspec.structs.replace(
                load(waiting=[(100, None)] * held, made_at=time.time()), max_queued_requests=2))

        report("r1", 2)
        report("r2", 2)
        assert book.room(time.time()) == 0
        ingress = await _ingress(tiny_model(), [FakeStream([ResponseStart(status=200), b"{}"])])
        hinted = []
        compute = ingress._hint
        ingress._hint = lambda *args: hinted.append(1) or compute(*args)
        body = {"model": "m", "prompt": "hello there", "max_tokens": 2}
        refused = await _call(ingress, "POST", "/v1/completions", body)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.headers["x-sloserve-rejected"] == "max_num_queued_reqs"
        assert "--max-num-queued-reqs" in refused.json()["error"]["message"]
        assert hinted == [] and ingress.engine.calls == []
        assert ('sloserve:fleet_rejected_total{reason="max_num_queued_reqs"} 1.0'
                in ingress.metrics.response().body.decode())
        report("r2", 1)
        served = await _call(ingress, "POST", "/v1/completions", body)
        assert served.status_code == 200 and hinted == [1] and len(ingress.engine.calls) == 1

    try:
        asyncio.run(run())
    finally:
        book_registry._BOOKS.pop(DEPLOYMENT, None)


def test_replies_stream_back_over_grpc_not_as_ray_objects(tiny_model):
    async def run():
        ingress = await _ingress(tiny_model(), [])
        assert ingress.engine.handle_options == {"stream": True, "_by_reference": False}

    asyncio.run(run())


def test_a_replica_that_dies_mid_stream_ends_it_with_an_error_event(tiny_model):
    async def run():
        import time
        book = FleetBook(seed=0)
        book_registry.register(DEPLOYMENT, book)
        book.on_report("r1", load(made_at=time.time()))
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
        parts = [ResponseStart(status=200, headers=[*SSE, (b"x-sloserve-replica", b"r1")]),
                 *_sse(chunk, chunk)]
        ingress = await _ingress(tiny_model(), [FakeStream(parts, fail_at=3)])
        response = await _call(ingress, "POST", "/v1/completions",
                               {"model": "m", "prompt": "x", "stream": True,
                                "ttft_slo_ms": 1000})
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[0]) == chunk and json.loads(events[1]) == chunk
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "replica serving this request failed" in error["message"]
        page = ingress.metrics.response().body.decode()
        assert "sloserve:fleet_failed_total 1.0" in page
        # Its first output was counted at the edge, against its objective.
        assert 'sloserve:fleet_ttft_slo_total{outcome="met"} 1.0' in page
        # The router stops predicting on the replica at once (and /health says degraded).
        assert book.fresh_and_stale(time.time()) == ([], ["r1"])

    try:
        asyncio.run(run())
    finally:
        book_registry._BOOKS.pop(DEPLOYMENT, None)


def test_the_api_key_is_checked_at_the_ingress_and_health_stays_open(tiny_model):
    async def run():
        ingress = await _ingress(tiny_model(), [], api_key="sesame")
        refused = await _call(ingress, "POST", "/v1/completions", {"prompt": "x"})
        assert refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
        assert ingress.engine.calls == []
        wrong = await _call(ingress, "GET", "/v1/models",
                            headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401

    asyncio.run(run())


def test_route_hints_carry_prompt_length_objective_and_prefix_hashes(tiny_model):
    async def run():
        ingress = await _ingress(tiny_model(), [], default_ttft_slo_ms=2000)
        ids = list(range(3, 3 + 40))
        hinted = ingress._hint("/v1/completions", json.dumps({"prompt": ids}).encode(), "250",
                               100.0)
        hint = hinted.hint
        assert hinted.prompts == [ids]  # forwarded with the request: the replica's prompt
        assert hint.prompt_tokens == 40 and hint.ttft_slo_s == 0.25 and hint.arrived_at == 100.0
        assert len(hint.prefix_hashes) == 40 // ingress.block_size
        # The body's objective wins over the header; without either, the server's default.
        body = json.dumps({"prompt": ids, "ttft_slo_ms": 75}).encode()
        assert ingress._hint("/v1/completions", body, "250", 0.0).hint.ttft_slo_s == 0.075
        default = ingress._hint("/v1/completions", json.dumps({"prompt": ids}).encode(), None,
                                0.0).hint
        assert default.ttft_slo_s == 2.0
        several = ingress._hint("/v1/completions",
                                json.dumps({"prompt": [ids, ids[:8]]}).encode(), None, 0.0)
        assert several.hint.prompt_tokens == 48 and several.prompts == [ids, ids[:8]]
        # A body the replica will refuse routes without a hint (its 400 names the problem),
        # and says why (tests/fleet/test_ingress_failures.py counts and logs it).
        for bad in (b"{not json", b'{"prompt": 5}', b'{"prompt": [3], "ttft_slo_ms": "x"}'):
            unhinted = ingress._hint("/v1/completions", bad, None, 0.0)
            assert isinstance(unhinted, Unhinted) and unhinted.reason == INVALID_BODY, bad

    asyncio.run(run())


def test_the_forwarded_request_carries_the_ids_its_hint_was_computed_from(tiny_model):
    """The replica prefills them rather than tokenizing the text again
    (tests/fleet/test_forwarded_prompts.py); a request without a hint carries none."""
    async def run():
        streams = [FakeStream([ResponseStart(status=200), b"{}"]) for _ in range(2)]
        ingress = await _ingress(tiny_model(), streams)
        await _call(ingress, "POST", "/v1/completions", {"prompt": "hello there"})
        await _call(ingress, "POST", "/v1/completions", {"prompt": 5})
        return ingress

    ingress = asyncio.run(run())
    (hinted, hint), (unhinted, no_hint) = ingress.engine.calls
    ids = ingress.inputs.encode("hello there")
    assert hinted.prompt_token_ids == [ids] and hint.prompt_tokens == len(ids)
    assert unhinted.prompt_token_ids is None and no_hint is None


def test_each_generation_request_takes_its_intake_turn_by_its_deadline(tiny_model):
    """The ingress takes a flood in turns (engine.serving.intake_turns, tested there), each at
    the place of the request's TTFT deadline, read from the body or the header before the
    hint; a request without an objective, or a body the hint will refuse, without one."""
    async def run():
        streams = [FakeStream([ResponseStart(status=200), b"{}"]) for _ in range(5)]
        ingress = await _ingress(tiny_model(), streams)
        turns: list[tuple[float | None, float]] = []
        take_turn = ingress.intake.turn

        async def recorded(deadline=None):
            turns.append((deadline, time.time()))
            await take_turn(deadline)

        ingress.intake.turn = recorded
        await _call(ingress, "POST", "/v1/completions", {"prompt": "hi", "ttft_slo_ms": 200})
        await _call(ingress, "POST", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}]},
                    headers={"x-slo-ttft-ms": "300"})
        await _call(ingress, "POST", "/v1/completions", {"prompt": "hi"})
        await _call(ingress, "POST", "/v1/completions", {"prompt": 5, "ttft_slo_ms": "x"})
        await _call(ingress, "GET", "/v1/models")
        return ingress, turns

    ingress, turns = asyncio.run(run())
    assert len(turns) == 4  # generation requests only
    (body_deadline, t1), (header_deadline, t2), (none, _), (bad, _) = turns
    assert 0.19 < body_deadline - t1 <= 0.2 and 0.29 < header_deadline - t2 <= 0.3
    assert none is None and bad is None
    assert ingress.intake.slices >= 1 and len(ingress.intake) == 0


def test_reject_mode_refuses_what_no_replica_can_serve_in_time(tiny_model):
    async def run():
        book = FleetBook(seed=0)
        book_registry.register(DEPLOYMENT, book)
        import time
        book.on_report("r1", load(running=[(30_000, None)], step_remaining_s=3.0,
                                  made_at=time.time()))
        ok = FakeStream([ResponseStart(status=200), b"{}"])
        ingress = await _ingress(tiny_model(), [ok], on_doomed="reject")
        refused = await _call(ingress, "POST", "/v1/completions",
                              {"prompt": list(range(3, 600)), "ttft_slo_ms": 20})
        assert refused.status_code == 429
        assert refused.json()["error"]["predicted_ttft_ms"] > 20
        assert refused.json()["error"]["ttft_slo_ms"] == 20
        assert int(refused.headers["retry-after"]) >= 3
        assert ingress.engine.calls == []  # no replica saw it
        served = await _call(ingress, "POST", "/v1/completions",
                             {"prompt": list(range(3, 600)), "ttft_slo_ms": 60_000})
        assert served.status_code == 200

    try:
        asyncio.run(run())
    finally:
        book_registry._BOOKS.pop(DEPLOYMENT, None)


def test_a_documents_hint_does_not_hold_up_a_short_turns(tiny_model, monkeypatch):
    """The hints are computed in the API server's two tokenizing lanes (a short turn's on the
    event loop itself): while a long document's hint is held on the long lane, a short turn's
    hint is computed and the turn forwarded."""
    import threading

    from engine.serving.tokenize_lanes import LONG_INPUT_CHARS

    async def run():
        streams = [FakeStream([ResponseStart(status=200), b"{}"]) for _ in range(2)]
        ingress = await _ingress(tiny_model(), streams)
        release, entered = threading.Event(), threading.Event()
        hint = ingress._hint
        lanes: dict[str, str] = {}

        def held_hint(path, body, slo_header, arrived_at, inputs=None):
            lanes[json.loads(body)["prompt"][:8]] = threading.current_thread().name
            if len(body) >= LONG_INPUT_CHARS:
                entered.set()
                release.wait(10)
            return hint(path, body, slo_header, arrived_at, inputs)

        monkeypatch.setattr(ingress, "_hint", held_hint)
        document = asyncio.create_task(_call(ingress, "POST", "/v1/completions",
                                             {"prompt": "document " * 3000}))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        turn = await asyncio.wait_for(_call(ingress, "POST", "/v1/completions",
                                            {"prompt": "a short turn"}), 5)
        assert turn.status_code == 200 and not document.done()  # the document still held
        release.set()
        assert (await document).status_code == 200
        # Probe: each took its own lane's thread.
        assert lanes["document"].startswith("sloserve-tokenize-long")
        assert lanes["a short "] == threading.current_thread().name  # the event loop's

    asyncio.run(run())


@pytest.mark.parametrize("chunk, shows", [
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n', False),
    (b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n', True),
    (b'data: {"choices": [{"index": 0, "text": ""}]}\n\n', False),
    (b'data: {"choices": [{"index": 0, "text": "x"}]}\n\ndata: [DONE]\n\n', True),
    (b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}\n\n', True),
    (b'data: {"error": {"message": "boom"}}\n\n', True),
    (b'{"id": "cmpl-1"}', True),
])
def test_what_counts_as_first_output(chunk, shows):
    assert carries_output(chunk) is shows


class _HeldStream(FakeStream):
    """A stream whose parts after the first (its ResponseStart) wait for `release`."""

    def __init__(self, parts: list) -> None:
        super().__init__(parts)
        self.total = len(parts)
        self.release = asyncio.Event()

    async def __anext__(self):
        if len(self.parts) < self.total:
            await self.release.wait()
        return await super().__anext__()


def test_a_documents_hint_waits_for_an_urgent_turns_first_output(tiny_model, monkeypatch):
    """A document's tokenization waits while a request with an earlier, near deadline still
    owes its first output (engine.serving.due_first_outputs): on a shared host it would take a
    core from that turn. It starts once the turn's first output is relayed, and nothing stays
    owed after either."""
    async def run():
        turn_stream = _HeldStream([ResponseStart(status=200, headers=SSE),
                                   *_sse({"choices": [{"index": 0, "text": "Hi"}]}, "[DONE]")])
        ingress = await _ingress(tiny_model(), [turn_stream,
                                                FakeStream([ResponseStart(status=200), b"{}"])])
        ingress.due.max_defer_s = 60.0  # held by the turn alone, however slow this host
        hint = ingress._hint
        hinted_at: dict[str, float] = {}

        def timed_hint(path, body, slo_header, arrived_at, inputs=None):
            hinted_at[json.loads(body)["prompt"][:8]] = time.time()
            return hint(path, body, slo_header, arrived_at, inputs)

        monkeypatch.setattr(ingress, "_hint", timed_hint)
        turn = asyncio.create_task(_call(ingress, "POST", "/v1/completions",
                                         {"prompt": "a short turn", "stream": True,
                                          "ttft_slo_ms": 300}))
        while len(ingress.due) == 0:  # forwarded, its first output owed
            await asyncio.sleep(0.01)
        document = asyncio.create_task(_call(ingress, "POST", "/v1/completions",
                                             {"prompt": "document " * 3000,
                                              "ttft_slo_ms": 10_000}))
        await asyncio.sleep(0.2)
        assert "document" not in hinted_at and not document.done()  # probe: held back
        released = time.time()
        turn_stream.release.set()
        assert (await turn).status_code == 200
        assert (await asyncio.wait_for(document, 10)).status_code == 200
        assert hinted_at["document"] >= released
        assert len(ingress.due) == 0

    asyncio.run(run())


def test_a_request_is_owed_from_its_arrival_before_its_intake_turn(tiny_model, monkeypatch):
    """An urgent turn still waiting for its intake turn already holds back a document's
    tokenization (its first output is owed from its arrival, not from its route), and is out
    again once answered."""
    async def run():
        ingress = await _ingress(tiny_model(), [FakeStream([ResponseStart(status=200),
                                                            b'{"ok": 1}'])])
        held = asyncio.Event()
        turn = ingress.intake.turn

        async def held_turn(deadline):
            await held.wait()
            return await turn(deadline)

        monkeypatch.setattr(ingress.intake, "turn", held_turn)
        document_deadline = time.time() + 10
        assert ingress.due.holding_back(document_deadline) == 0
        call = asyncio.create_task(_call(ingress, "POST", "/v1/completions",
                                         {"prompt": "a short turn", "ttft_slo_ms": 300}))
        while ingress._preparing == 0:  # arrived, waiting for its intake turn
            await asyncio.sleep(0.005)
        assert ingress.due.holding_back(document_deadline) == 1  # owed while in the queue
        held.set()
        assert (await asyncio.wait_for(call, 10)).status_code == 200
        assert len(ingress.due) == 0

    asyncio.run(run())
