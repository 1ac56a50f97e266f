"""A fleet of two real (tiny, slowed) replicas on Ray Serve: the OpenAI API through the ingress,
the slack router sending an urgent request away from a replica in the middle of a long prefill,
the fleet's /metrics against the client's clock, a replica killed, and a fleet drained."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest

# Ray Serve comes with the cluster extra, which the README's test command installs.
pytest.importorskip("ray.serve", reason="the fleet's tests need Ray Serve: pip install -e "
                                        "'.[test,cluster]'")

from bench.diagnostics import fleet_status_cost
from engine.fleet.options import APP_NAME, ENGINE_DEPLOYMENT, FleetOptions
from tests.utils.ray_fleet import (fleet, in_thread, metric, replica_env, stream,
                                   tiny_fleet_config, wait_for)

# Alone (the README's serial run): the session's one Ray instance, and replicas timed against
# each other on the machine's cores.
pytestmark = pytest.mark.serial

# Slowed layers (4 layers x 250 us per token): a 1500-token prompt prefills in ~1.5 s, a
# 24-token turn in ~25 ms.
DELAY_US_PER_TOKEN = 250
LONG_PROMPT = [3 + (i * 7919) % 247 for i in range(1500)]  # token ids inside the tiny vocab
URGENT_SLO_MS = 600


@pytest.fixture(scope="module")
def tiny_fleet(tiny_model, ray_serve_port):
    model = tiny_model("llama", num_hidden_layers=4, max_position_embeddings=2048)
    options = FleetOptions(replicas=2, router="slack", router_seed=0,
                           replica_env=replica_env(DELAY_US_PER_TOKEN))
    with fleet(ray_serve_port, tiny_fleet_config(model, max_model_len=2048), options) as url:
        yield url


def _urgent(seed: int) -> dict:
    return {"model": "tiny", "prompt": [3 + (seed * 31 + i) % 247 for i in range(24)],
            "max_tokens": 3,
            "ttft_slo_ms": URGENT_SLO_MS}


def test_fleet_serves_the_openai_api_with_streaming(tiny_fleet):
    url = tiny_fleet
    models = httpx.get(f"{url}/v1/models", timeout=30).json()
    assert models["data"][0]["id"] == "tiny"
    body = {"model": "tiny", "prompt": "the fleet answers", "max_tokens": 6}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["text"]
    # Greedy output does not depend on the replica: ask until both have answered.
    texts = {first.headers["x-sloserve-replica"]: answer["choices"][0]["text"]}
    for _ in range(12):
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        texts.setdefault(again.headers["x-sloserve-replica"], again.json()["choices"][0]["text"])
        if len(texts) == 2:
            break
    assert len(texts) == 2, f"every request went to one replica: {texts}"
    assert len(set(texts.values())) == 1, texts
    chat = stream(url, {"model": "tiny", "max_tokens": 5,
                        "messages": [{"role": "user", "content": "hello"}]},
                  path="/v1/chat/completions")
    assert chat.status == 200 and chat.error is None and chat.done, chat
    assert chat.events[0]["choices"][0]["delta"].get("role") == "assistant"
    assert chat.text(), chat.events
    # Bad input is answered by the server's own validation, through the ingress.
    bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x",
                                                    "max_tokens": -1}, timeout=30)
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["replicas"]["reporting"] == 2, health
    # /health reads the deployment from the controller's dict as it comes
    # (engine.fleet.fleet_health.serve_details), not through serve.status(): the same answer.
    from ray import serve

    overview = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
    assert health["deployment"] == {"status": "HEALTHY", "replica_states": {"RUNNING": 2},
                                    "message": overview.message}, health
    assert overview.status.value == "HEALTHY" and overview.replica_states == {"RUNNING": 2}
    with pytest.raises(SystemExit) as agreed:  # the diagnostic that times both reads
        fleet_status_cost.main(["--calls", "2"])
    assert agreed.value.code == 0
    # The ingress replica served all of it on the fleet's port itself
    # (engine.fleet.ingress_http), with Ray Serve's direct ingress off and no HTTP proxy, in Ray
    # Serve's throughput-optimized mode with its router on a loop of its own, handing requests
    # to the replicas over gRPC (engine.fleet.launch.RAY_SERVE_ENV), as the Ray this session
    # started told it to.
    ingress_pid = _actor_pid("SloserveIngress")
    environment = _environment(ingress_pid)
    assert environment.get("RAY_SERVE_PROXY_USE_GRPC") == "1"
    assert environment.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1"
    assert environment.get("RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP") == "1"
    assert environment.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "0"
    assert _on_actor("SloserveIngress", _router_loop_running), (
        "the ingress's router runs on the ingress's own event loop")
    port = int(url.rsplit(":", 1)[1])
    assert port in _listening_ports(ingress_pid)
    assert not serve.status().proxies, "Ray Serve runs no HTTP proxy for the fleet"


def _on_actor(name_part: str, fn):
    """``fn()``'s value, called in the process of the named actor whose name holds `name_part`."""
    import ray

    found = next(n for n in ray.util.list_named_actors(all_namespaces=True)
                 if name_part in n["name"])
    actor = ray.get_actor(found["name"], namespace=found["namespace"])
    return ray.get(actor.__ray_call__.remote(lambda self: fn()))


def _actor_pid(name_part: str) -> int:
    return _on_actor(name_part, os.getpid)


def _router_loop_running() -> bool:
    """Whether Ray Serve's routers in this process run on their own loop (a thread it starts
    for them: RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP), not on the caller's."""
    from ray.serve._private.router import SingletonThreadRouter

    loop = SingletonThreadRouter._asyncio_loop
    return loop is not None and loop.is_running()


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on: its sockets' inodes, found in /proc/net/tcp."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_urgent_request_goes_around_a_replica_in_the_middle_of_a_long_prefill(tiny_fleet):
    url = tiny_fleet
    long_thread, long_out = in_thread(stream, url, {"model": "tiny", "prompt": LONG_PROMPT,
                                                    "max_tokens": 2})
    # The probe: the replica's own report (through the fleet's /metrics) shows the long prompt
    # being prefilled, and its step running, before the urgent request is sent.
    def busy_replica() -> str | None:
        page = httpx.get(f"{url}/metrics", timeout=10).text
        for line in page.splitlines():
            if line.startswith("sloserve:fleet_step_remaining_seconds{"):
                replica = line.split('"')[1]
                queued = metric(page, "sloserve:fleet_queued_prefill_tokens", replica=replica)
                if float(line.rsplit(" ", 1)[1]) > 0.2 and queued and queued >= 1000:
                    return replica
        return None

    busy = wait_for(busy_replica, timeout=30, what="a replica reporting the long prefill")
    sent_at = time.monotonic()
    urgent = stream(url, _urgent(7))
    urgent_done = time.monotonic()
    long_thread.join(timeout=60)
    (long,) = long_out
    assert urgent.status == 200 and urgent.done and long.done, (urgent, long)
    assert long.replica == busy, "the probe watched the replica that served the long prompt"
    assert urgent.replica != busy, "the urgent request was sent to the replica mid-prefill"
    assert urgent.first_output_at is not None and urgent.first_output_at * 1e3 < URGENT_SLO_MS
    # The long prefill was still running when the urgent request was answered.
    assert long.first_output_at is not None
    assert urgent_done - sent_at < long.first_output_at, (urgent, long)


def test_fleet_metrics_agree_with_the_client(tiny_fleet):
    url = tiny_fleet
    before = httpx.get(f"{url}/metrics", timeout=10).text
    count_before = metric(before, "vllm:time_to_first_token_seconds_count") or 0.0
    sum_before = metric(before, "vllm:time_to_first_token_seconds_sum") or 0.0
    met_before = metric(before, "sloserve:fleet_ttft_slo_total", outcome="met") or 0.0
    results = [stream(url, _urgent(100 + i)) for i in range(3)]
    assert all(r.status == 200 and r.done for r in results), results
    after = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric(after, "vllm:time_to_first_token_seconds_count") == count_before + 3
    server_sum = metric(after, "vllm:time_to_first_token_seconds_sum") - sum_before
    client_sum = sum(r.first_output_at for r in results)
    # Stamped at the fleet's edge, as the chunk leaves: never after the client has it, and
    # not much before.
    assert server_sum <= client_sum + 0.01 and client_sum - server_sum < 0.1 * 3, (
        server_sum, client_sum)
    met = (metric(after, "sloserve:fleet_ttft_slo_total", outcome="met") or 0.0) - met_before
    assert met == sum(r.first_output_at * 1e3 < URGENT_SLO_MS for r in results)
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc"):
        assert after.count(f"{name}{{replica=") == 2, name


def _replica_pid(replica_id: str) -> int:
    import ray

    name = next(n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
                if n["name"].endswith(replica_id) and "SloserveEngine" in n["name"])
    actor = ray.get_actor(name, namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def test_a_killed_replica_fails_its_stream_clearly_and_the_fleet_recovers(tiny_fleet):
    url = tiny_fleet
    victim_stream: dict = {}

    def long_stream():
        victim_stream["result"] = stream(url, {"model": "tiny", "prompt": LONG_PROMPT[:300],
                                               "max_tokens": 400, "ignore_eos": True})

    thread = threading.Thread(target=long_stream, daemon=True)
    thread.start()
    # Wait until its tokens flow, so the kill lands mid-stream.
    page = lambda: httpx.get(f"{url}/metrics", timeout=10).text  # noqa: E731
    wait_for(lambda: any(metric(page(), "vllm:num_requests_running", replica=r) for r in
                         _replicas(page())), timeout=30, what="the stream to run")
    time.sleep(0.5)
    victim = next(r for r in _replicas(page())
                  if metric(page(), "vllm:num_requests_running", replica=r))
    os.kill(_replica_pid(victim), signal.SIGKILL)
    thread.join(timeout=60)
    result = victim_stream["result"]
    assert result.status == 200 and result.replica == victim
    # The stream ends with an error event and [DONE], not a hang or a cut connection.
    assert result.done and isinstance(result.events[-2], dict) and "error" in result.events[-2], (
        result.events[-3:])
    assert "replica" in result.events[-2]["error"]["message"]
    # The fleet says so, and keeps serving on the other replica meanwhile.
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.json()["status"] == "degraded", health.text
    for seed in range(3):
        answer = httpx.post(f"{url}/v1/completions", json=_urgent(200 + seed), timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-sloserve-replica"] != victim
    # Ray Serve replaces it; the fleet is whole again.
    wait_for(lambda: httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok",
             timeout=120, interval=1.0, what="the replaced replica to report")
    assert victim not in _replicas(page())


def _replicas(page: str) -> list[str]:
    return [line.split('"')[1] for line in page.splitlines()
            if line.startswith("vllm:num_requests_running{")]


def test_a_removed_fleet_drains_its_streams(tiny_fleet):
    """Last in the module: it deletes the fleet. Ray Serve stops routing to the replicas and
    waits for their streams (graceful_shutdown_timeout_s) before their engines stop."""
    from ray import serve

    url = tiny_fleet
    thread, out = in_thread(stream, url, {"model": "tiny", "prompt": LONG_PROMPT[:200],
                                          "max_tokens": 120, "ignore_eos": True})
    page = lambda: httpx.get(f"{url}/metrics", timeout=10).text  # noqa: E731
    wait_for(lambda: any(metric(page(), "vllm:num_requests_running", replica=r)
                         for r in _replicas(page())), timeout=30, what="the stream to run")
    deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
    deleting.start()
    deleted_while_streaming = wait_for(lambda: thread.is_alive() and APP_NAME not in
                                       _running_apps(), timeout=5, interval=0.02,
                                       what="the delete to begin during the stream")
    thread.join(timeout=120)
    deleting.join(timeout=120)
    (result,) = out
    assert deleted_while_streaming
    assert result.status == 200 and result.error is None and result.done, result
    assert not any(isinstance(e, dict) and "error" in e for e in result.events)
    # Every token it asked for: the stream ran to max_tokens, not to an end the drain forced.
    finish = [c["finish_reason"] for e in result.events if isinstance(e, dict)
              for c in e["choices"] if c.get("finish_reason")]
    assert finish == ["length"], result.events[-3:]


def _running_apps() -> set[str]:
    from ray import serve

    return {name for name, app in serve.status().applications.items()
            if str(app.status.value) == "RUNNING"}
