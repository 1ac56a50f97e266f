"""Fleets on a real Ray Serve for the cluster tests (test helper).

One Ray instance serves the whole test session (`ray_serve_port`, a session fixture registered
by tests/fleet/conftest.py), its fleets' ingress on one port; each test module deploys the fleet
it needs as the `sloserve` application and deletes it after, leaving Ray up for the next."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from engine.ports import free_port
from engine.config import EngineConfig, build_engine_config
from engine.fleet.options import FleetOptions
from engine.serving.api_server import ServerSettings
from workers.preemption.layer_delay import LAYER_DELAY_ENV

# A chat template for the tiny tokenizer (which has none), so chat streams can be tested.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")



@pytest.fixture(scope="session")
def ray_serve_port() -> Iterator[int]:
    """A Ray instance for every cluster test, and a free port its fleets serve on (one after
    another: each fleet's ingress binds it itself, engine.fleet.ingress_http)."""
    import ray
    from ray import serve

    from engine.fleet.launch import init_ray

    port = free_port()
    init_ray(num_cpus=2, log_to_driver=False)
    try:
        yield port
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def tiny_fleet_config(model: str, **overrides) -> EngineConfig:
    args = dict(device="cpu", dtype="float32", num_kv_blocks=512, block_size=16,
                chat_template=CHAT_TEMPLATE)
    args.update(overrides)
    return build_engine_config(model, **args)


def replica_env(delay_us_per_token: int | None = None) -> dict[str, str]:
    env = {"SLOSERVE_STARTUP_CALIBRATION_S": os.environ.get("SLOSERVE_STARTUP_CALIBRATION_S",
                                                            "0.3"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           # Two replicas share two cores: one torch thread each.
           "OMP_NUM_THREADS": "1"}
    if delay_us_per_token is not None:
        env[LAYER_DELAY_ENV] = str(delay_us_per_token)
    return env


@contextlib.contextmanager
def fleet(port: int, config: EngineConfig, options: FleetOptions,
          settings: ServerSettings | None = None) -> Iterator[str]:
    from engine.fleet.launch import start_fleet, stop_fleet

    settings = settings or ServerSettings(served_model_name="tiny")
    url = start_fleet(config, settings, options, port=port, ready_timeout_s=300)
    try:
        yield url
    finally:
        stop_fleet(shutdown_ray=False)


@dataclass
class StreamResult:
    status: int = 0
    replica: str | None = None
    headers_at: float | None = None
    # When the first chunk with output arrived (the client's TTFT clock), and every event.
    first_output_at: float | None = None
    events: list[dict | str] = field(default_factory=list)
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def text(self) -> str:
        return "".join(c.get("text", "") or (c.get("delta") or {}).get("content", "")
                       for e in self.events if isinstance(e, dict)
                       for c in e.get("choices", []))


def stream(url: str, body: dict, path: str = "/v1/completions",
           headers: dict | None = None, timeout: float = 120.0) -> StreamResult:
    """A streamed request, timed by the client."""
    result = StreamResult()
    # The client is built before the clock starts: building one (its TLS context) takes
    # 90-290 ms on some hosts, which is the client's setup, not the fleet's answer.
    client = httpx.Client(timeout=timeout)
    started = time.monotonic()
    try:
        with client, client.stream("POST", url + path, json={**body, "stream": True},
                                   headers=headers or {}) as response:
            result.status = response.status_code
            result.replica = response.headers.get("x-sloserve-replica")
            result.headers_at = time.monotonic() - started
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    result.events.append("[DONE]")
                    continue
                event = json.loads(payload)
                result.events.append(event)
                if result.first_output_at is None and any(
                        c.get("text") or (c.get("delta") or {}).get("content")
                        for c in event.get("choices", [])):
                    result.first_output_at = time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result.error = exc
    return result


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, out


def metric(text: str, name: str, **labels: str) -> float | None:
    """A sample's value from a Prometheus text page (None when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return None


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
