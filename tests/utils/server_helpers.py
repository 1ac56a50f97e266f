"""Helpers for the HTTP server tests: a real `sloserve serve` subprocess, SSE parsing, the
Prometheus text, and the process tree under the server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx

from engine.benchmarks.server import wait_until_healthy
from engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]


# ---- the process tree ---------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc/<pid>/task/*/children."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the task or the process went away
            pass
    return sorted(set(found))


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in out:
                out.append(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "?"


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Waits until none of `pids` is alive; returns those still alive after `timeout`."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# ---- the server ---------------------------------------------------------------------------------


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def copy_with_chat_template(model_dir: str, folder: Path, template: str = CHAT_TEMPLATE) -> str:
    """A copy of a tiny model folder whose tokenizer carries `template` (default CHAT_TEMPLATE),
    so the server and the offline LLM both read the same template."""
    shutil.copytree(model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return str(folder)

class ServerProcess:
    """`python -m engine serve ...` on a free loopback port, output to a log file. `module`
    runs another entry point that takes the same arguments (a test's patched server), with
    `env` added to its environment and the variables in `unset` removed from it; `affinity`:
    the CPUs it (and so every process it starts) may run on."""

    def __init__(self, model: str, log_path: Path, *extra: str, api_key: str | None = None,
                 startup_timeout: float = 120.0, module: str = "engine",
                 env: dict[str, str] | None = None, unset: tuple[str, ...] = (),
                 affinity: set[int] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(log_path)
        args = [sys.executable, "-m", module, "serve", "--model", model,
                "--dtype", "float32", "--port", str(self.port), "--log-level", "info", *extra]
        if api_key is not None:
            args += ["--api-key", api_key]
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                       "PYTHONUNBUFFERED": "1", **(env or {})}
        environment.pop("SLOSERVE_API_KEY", None)
        for name in unset:
            environment.pop(name, None)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        pin = None if affinity is None else (lambda: os.sched_setaffinity(0, affinity))
        self.proc = subprocess.Popen(args, cwd=REPO, env=environment, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=pin)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self, tail: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def _wait_healthy(self, timeout: float) -> None:
        try:
            wait_until_healthy(self.proc, self.url, timeout, self.log, poll_s=0.1)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from exc

    def stats(self) -> dict:
        response = httpx.get(f"{self.url}/debug/stats", headers=self.auth, timeout=5.0)
        response.raise_for_status()
        return response.json()

    def wait_all_blocks_free(self, timeout: float = 5.0) -> tuple[dict, float]:
        """Polls /debug/stats until every KV block is free; returns (stats, seconds taken)."""
        start = time.monotonic()
        while True:
            stats = self.stats()
            took = time.monotonic() - start
            if stats["num_free_blocks"] == stats["num_blocks"] or took > timeout:
                return stats, took
            time.sleep(0.02)

    def stop(self, timeout: float = 30.0) -> tuple[int, float, list[int]]:
        """SIGTERM; returns (exit code, seconds to exit, descendants still alive 5 s later)."""
        tree = descendants(self.pid)
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout} s of SIGTERM:\n"
                                 f"{self.log()}")
        took = time.monotonic() - start
        left = wait_gone(tree, 5.0)
        for pid in left:  # do not leak them into the rest of the session
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self._log.close()
        return code, took, left

    def assert_clean_stop(self, timeout: float = 30.0) -> float:
        """SIGTERM and check the exit was clean; returns the seconds it took."""
        tree = descendants(self.pid)
        assert tree, "the server should have an EngineCore child process"
        code, took, left = self.stop(timeout)
        assert_clean_exit(code, self.log(tail=100_000))
        assert not left, f"processes left behind: {[(p, cmdline(p)) for p in left]}"
        return took

    def kill(self) -> None:
        if self.proc.poll() is None:
            tree = descendants(self.pid)
            self.proc.kill()
            self.proc.wait()
            for pid in tree:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if not self._log.closed:
            self._log.close()


def assert_clean_exit(code: int, log: str) -> None:
    """uvicorn shuts down gracefully on SIGTERM and then re-raises the signal (so that the
    parent sees how it ended): -SIGTERM is a clean exit when the log shows the lifespan shutdown
    (which stops and reaps EngineCore) completed."""
    assert code in (0, -signal.SIGTERM), f"server exited with {code}:\n{log[-4000:]}"
    assert "Application shutdown complete." in log, log[-4000:]
    assert "Finished server process" in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]


# ---- server-sent events -------------------------------------------------------------------------

def sse_data(lines: Iterable[str]) -> Iterator[dict | str]:
    """The `data:` payloads of an SSE stream: dicts, and the final "[DONE]" as a string."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        yield payload if payload == "[DONE]" else json.loads(payload)


def collect_stream(events: Iterable[dict | str]) -> dict:
    """Folds completion/chat chunks into text, finish_reason, metrics, usage, error, done."""
    out: dict = {"text": "", "finish_reason": None, "metrics": None, "usage": None,
                 "error": None, "done": False, "chunks": 0}
    for event in events:
        if event == "[DONE]":
            out["done"] = True
            continue
        assert not out["done"], "event after [DONE]"
        if "error" in event:
            out["error"] = event["error"]
            continue
        out["chunks"] += 1
        for choice in event.get("choices", []):
            delta = choice.get("delta")
            out["text"] += (delta.get("content") or "") if delta is not None else choice["text"]
            if choice.get("finish_reason") is not None:
                out["finish_reason"] = choice["finish_reason"]
        if event.get("metrics") is not None:
            out["metrics"] = event["metrics"]
        if event.get("usage") is not None:
            out["usage"] = event["usage"]
    return out


# ---- Prometheus ---------------------------------------------------------------------------------

def scrape(url: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """Parses /metrics: ({family name: type}, {(sample name, labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=5.0)
    response.raise_for_status()
    families, samples = {}, {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return families, samples


def sample(samples: dict, name: str, **labels: str) -> float:
    """Sum over the samples named `name` whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


# A tiny model's layers slowed to this many microseconds per token (workers.model_runner's
# LAYER_DELAY_ENV): a 400-token prefill of 8 layers lasts about a second, long enough for an
# urgent request to arrive in the middle of it.
SLOWED_LAYERS = 8
SLOWED_US_PER_TOKEN = 300


def slowed_slo_server(tiny_model, tmp_path: Path, monkeypatch, module: str = "engine"
                      ) -> ServerProcess:
    """`sloserve serve` of a tiny model whose layers are slowed, with the slo policy,
    preemptible steps from 32 prompt tokens and the slowed layers' TTFT line (2.4 ms per
    token), so that the monitor knows how much of a long step is left when an urgent request
    arrives. `module`: a test's patched server (see ServerProcess)."""
    from monitor.step_time_model import StepTimeModel
    from workers.preemption.layer_delay import LAYER_DELAY_ENV

    monkeypatch.setenv(LAYER_DELAY_ENV, str(SLOWED_US_PER_TOKEN))
    model = tiny_model("llama", num_hidden_layers=SLOWED_LAYERS, max_position_embeddings=1024)
    ttft = tmp_path / "ttft.json"
    StepTimeModel(seconds_per_token=SLOWED_LAYERS * SLOWED_US_PER_TOKEN * 1e-6,
                  intercept_s=0.02).save(ttft)
    return ServerProcess(model, tmp_path / "server.log", "--scheduling-policy", "slo",
                         "--slo-preempt-min-tokens", "32", "--num-kv-blocks", "160",
                         "--max-num-batched-tokens", "1024", "--ttft-model", str(ttft),
                         module=module)
