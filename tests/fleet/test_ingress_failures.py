"""Failures at the fleet's edge are loud: a router that cannot start makes the ingress's /health
unavailable with its error (logged in full, once per new error); a request whose route hint
cannot be computed is forwarded with its reason logged and counted; `--on-doomed reject` before
the router exists says so; a ranking failure in the router is counted in the fleet's /metrics;
and the router weighs the very prompt the replica renders (tools and template variables
included). Each is paired with a probe that the failure really happened. Stand-ins for Ray's
actors (tests/utils/fleet_ingress.py): no cluster starts."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="the fleet's tests need Ray Serve: pip install -e "
                                        "'.[test,cluster]'")

import engine.fleet.ingress as ingress_module
from engine.fleet import book_registry
from engine.fleet.asgi_bridge import ResponseStart
from engine.fleet.book_registry import fleet_book
from engine.fleet.fleet_metrics import FleetMetrics
from engine.fleet.ingress import CHAT_PROMPT, HINT_ERROR, MAX_ROUTED_BLOCKS
from engine.load.prefix_hashes import prompt_prefix_hashes
from engine.processing.input_processor import InputProcessor
from engine.serving.api_server import ServerSettings
from tests.utils.fleet_ingress import DEPLOYMENT, FakeStream, call, start_ingress
from tests.utils.inprocess_server import FakeCore, app_client
from tests.utils.server_helpers import copy_with_chat_template

HEALTHY = {"status": "HEALTHY", "replica_states": {"RUNNING": 2}, "message": ""}
JSON_OK = [ResponseStart(status=200, headers=[(b"content-type", b"application/json")]), b"{}"]


@pytest.fixture(autouse=True)
def no_books():
    """Each test starts with no router book in this process, and leaves none."""
    book_registry._BOOKS.pop(DEPLOYMENT, None)
    yield
    book_registry._BOOKS.pop(DEPLOYMENT, None)


def _page(ingress) -> str:
    return ingress.metrics.response().body.decode()


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_a_router_that_cannot_start_makes_health_unavailable_with_the_error(
        tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(ingress_module, "ROUTER_RETRY_S", 0.01)
    monkeypatch.setattr(ingress_module, "ROUTER_RELOG_S", 0.05)
    caplog.set_level(logging.INFO, logger="engine.fleet.ingress")

    async def run():
        error = RuntimeError("the engine deployment has no route: boom")
        ingress = await start_ingress(tiny_model(), [], probe_errors=[error] * 10_000)
        ingress.health._deployment_status = lambda: HEALTHY  # no Serve controller here
        # Probe: the warm-up's probe really fails, again and again.
        await _until(lambda: ingress.engine.probes >= 3)
        await _until(lambda: any("still cannot start" in r.getMessage()
                                 for r in caplog.records))
        during = await call(ingress, "GET", "/health")
        ingress.engine.probe_errors.clear()  # the replicas answer from now on
        await _until(lambda: ingress.router_start.started)
        after = await call(ingress, "GET", "/health")
        return during, after, ingress

    during, after, ingress = asyncio.run(run())
    assert during.status_code == 503
    report = during.json()
    assert report["status"] == "unavailable"
    assert report["router"]["started"] is False and report["router"]["attempts"] >= 3
    assert report["router"]["error"] == "RuntimeError: the engine deployment has no route: boom"
    # Logged in full (the traceback), once for the same error however many tries failed
    # (again, as an error, only while it goes on for ROUTER_RELOG_S).
    failures = [r for r in caplog.records if "router cannot start" in r.getMessage()]
    assert len(failures) == 1 and failures[0].levelno == logging.WARNING
    assert all(r.levelno == logging.ERROR and "boom" in r.getMessage()
               for r in caplog.records if "still cannot start" in r.getMessage())
    assert failures[0].exc_info is not None and "boom" in str(failures[0].exc_info[1])
    assert any("the router started" in r.getMessage() for r in caplog.records)
    # Once the router has started, /health reports the fleet again.
    assert after.status_code == 200 and after.json()["status"] == "ok"
    assert after.json()["router"] == {"started": True, "attempts": ingress.engine.probes,
                                      "error": None}


def test_reject_mode_before_the_router_exists_serves_and_says_so(tiny_model, caplog):
    caplog.set_level(logging.WARNING, logger="engine.fleet.ingress")

    async def run():
        ingress = await start_ingress(tiny_model(), [FakeStream(list(JSON_OK))],
                                      on_doomed="reject")
        # Probe: no router book exists (the fake handle creates no router), so nothing is
        # known to judge the request by.
        assert fleet_book(DEPLOYMENT) is None
        response = await call(ingress, "POST", "/v1/completions",
                              {"prompt": list(range(3, 40)), "ttft_slo_ms": 1})
        return response, ingress

    response, ingress = asyncio.run(run())
    assert response.status_code == 200 and len(ingress.engine.calls) == 1
    assert 'sloserve:fleet_unassessed_total{reason="router_not_started"} 1.0' in _page(ingress)
    assert any("admitted unassessed" in r.getMessage() for r in caplog.records)


def test_a_chat_prompt_the_replica_refuses_is_forwarded_counted_and_logged(tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="engine.fleet.ingress")
    refusal = [ResponseStart(status=400, headers=[(b"content-type", b"application/json")]),
               b'{"error": {"message": "messages: no chat template", "code": 400}}']

    async def run():
        # The tiny tokenizer has no chat template: the hint's rendering fails as the
        # replica's will.
        ingress = await start_ingress(tiny_model(), [FakeStream(refusal)], on_doomed="reject")
        body = {"messages": [{"role": "user", "content": "hi"}], "ttft_slo_ms": 50}
        probe = ingress._hint("/v1/chat/completions", json.dumps(body).encode(),
                              None, 0.0)
        response = await call(ingress, "POST", "/v1/chat/completions", body)
        return probe, response, ingress

    probe, response, ingress = asyncio.run(run())
    # Probe: the hint really could not be computed, for the replica's own reason.
    assert probe.reason == CHAT_PROMPT and "no chat template" in probe.detail
    # The replica's own 400 reached the client; the request went without a hint.
    assert response.status_code == 400 and "no chat template" in response.text
    assert ingress.engine.calls[0][1] is None
    assert f'sloserve:fleet_unassessed_total{{reason="{CHAT_PROMPT}"}} 1.0' in _page(ingress)
    assert any("without a route hint" in r.getMessage() and "no chat template" in r.getMessage()
               for r in caplog.records)


def test_a_failure_of_the_hints_own_code_is_logged_with_its_traceback(tiny_model, caplog,
                                                                      monkeypatch):
    caplog.set_level(logging.INFO, logger="engine.fleet.ingress")
    calls: list[str] = []

    def broken_encode(_self, prompt: str, *_args, **_kwargs) -> list[int]:
        calls.append(prompt)
        raise KeyError("a tokenizer bug")

    async def run():
        ingress = await start_ingress(tiny_model(), [FakeStream(list(JSON_OK))])
        # On the class: a short prompt is encoded inline, by the lanes' GIL-holding view of
        # the ingress's processor (InputProcessor.holding_gil).
        monkeypatch.setattr(InputProcessor, "encode", broken_encode)
        response = await call(ingress, "POST", "/v1/completions",
                              {"prompt": "hello there", "ttft_slo_ms": 500})
        return response, ingress

    response, ingress = asyncio.run(run())
    assert calls == ["hello there"]  # probe: the hint's code really failed
    assert response.status_code == 200 and ingress.engine.calls[0][1] is None
    assert f'sloserve:fleet_unassessed_total{{reason="{HINT_ERROR}"}} 1.0' in _page(ingress)
    logged = [r for r in caplog.records if "could not compute the route hint" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR
    assert isinstance(logged[0].exc_info[1], KeyError)


TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>Tools: {{ tools | tojson }}\n{% endif %}"
    "{%- if persona %}<|system|>You are {{ persona }}.\n{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def test_the_router_renders_a_chat_prompt_as_the_replica_does(tiny_model, tmp_path):
    """Tools and template variables reach the router's rendering: its prompt length and prefix
    hashes are those of the prompt the replica's server sends its engine, for a chat request and
    for the same turn sent to /v1/responses."""
    from transformers import AutoTokenizer

    model = copy_with_chat_template(tiny_model(), tmp_path / "tools-model", TOOLS_TEMPLATE)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [TOOL], "tool_choice": "none", "max_tokens": 1,
            "chat_template_kwargs": {"persona": "a weather clerk"}}

    # The same turn through the Responses API: its flat tools, its own field names.
    responses_body = {"model": "tiny", "input": "Weather in Paris?",
                      "tools": [{"type": "function", **TOOL["function"]}], "tool_choice": "none",
                      "max_output_tokens": 1,
                      "chat_template_kwargs": {"persona": "a weather clerk"}}

    async def replica_prompt(path: str, sent: dict) -> list[int]:
        fake = FakeCore(len(AutoTokenizer.from_pretrained(model)), max_model_len=4096)
        async with app_client(model, ServerSettings(served_model_name="tiny"), fake=fake) as (
                http, _):
            response = await http.post(path, json=sent)
            assert response.status_code == 200, response.text
        return fake.requests[0].prompt_token_ids

    async def hints():
        ingress = await start_ingress(model, [])
        chat = [ingress._hint("/v1/chat/completions", json.dumps(b).encode(), None, 0.0).hint
                for b in (body, {**body, "tools": None}, {**body, "chat_template_kwargs": None})]
        return [*chat, ingress._hint("/v1/responses", json.dumps(responses_body).encode(),
                                     None, 0.0).hint]

    ids = asyncio.run(replica_prompt("/v1/chat/completions", body))
    responses_ids = asyncio.run(replica_prompt("/v1/responses", responses_body))
    routed, without_tools, without_kwargs, responses = asyncio.run(hints())
    assert responses_ids == ids  # the same turn, rendered alike by both routes
    assert (responses.prompt_tokens, responses.prefix_hashes) == (routed.prompt_tokens,
                                                                  routed.prefix_hashes)
    assert routed.prompt_tokens == len(ids)
    assert routed.prefix_hashes == prompt_prefix_hashes(ids, 16, MAX_ROUTED_BLOCKS)
    assert len(routed.prefix_hashes) >= 2
    # Probe: the tools and the template variable change the prompt, so a router that dropped
    # either would weigh another one.
    assert without_tools.prompt_tokens < routed.prompt_tokens
    assert without_kwargs.prompt_tokens < routed.prompt_tokens


def test_a_ranking_failure_is_counted_in_the_fleet_metrics(caplog):
    from engine.fleet.ray_router import DeadlineRouter

    router = DeadlineRouter.__new__(DeadlineRouter)  # Ray Serve's own __init__ needs a cluster
    router._deployment_id = SimpleNamespace(name=DEPLOYMENT)
    router.initialize_state(policy="slack", seed=0)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid), routing_stats={})
                for rid in ("r1", "r2")]
    metrics = FleetMetrics(lambda: fleet_book(DEPLOYMENT))

    healthy = asyncio.run(router.choose_replicas(replicas, None))
    assert sorted(rid for rank in healthy for rid in
                  (r.replica_id.unique_id for r in rank)) == ["r1", "r2"]
    assert "sloserve:fleet_ranking_failures_total{" not in metrics.response().body.decode()

    def broken_rank(*_args, **_kwargs):
        raise ZeroDivisionError("a policy bug")

    router.book.rank = broken_rank
    fallback = asyncio.run(router.choose_replicas(replicas, None))
    # Probe: ranking really failed (logged), and Ray Serve's order took over.
    assert fallback == [replicas]
    assert any("ranking failed" in r.getMessage() for r in caplog.records)
    page = metrics.response().body.decode()
    assert 'sloserve:fleet_ranking_failures_total{error="ZeroDivisionError"} 1.0' in page
