"""A `sloserve serve` subprocess per benchmark cell, so that the HTTP runner measures each policy
on a fresh server (no prefix-cache hits carried over from the previous run).

`serve(..., log_path=PATH)` appends the server's log (info level) to PATH as the server writes
it, after a header line naming the cell, so the output folder keeps what each server did even
when the benchmark is killed; without a path the log is a temporary file at warning level,
quoted only when the server fails to start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from engine.benchmarks.attainment.policies import PolicySpec

# Engine overrides that map onto `sloserve serve` flags.
_FLAGS = {"dtype": "--dtype", "num_kv_blocks": "--num-kv-blocks",
          "max_model_len": "--max-model-len", "ttft_model": "--ttft-model",
          "preempt_min_tokens": "--preempt-min-tokens", "simulate": "--simulate",
          "device": "--device", "load_format": "--load-format"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float,
                       log: Callable[[], str], poll_s: float = 0.2) -> None:
    """Returns once `url`/health answers 200; RuntimeError with the server's log if the process
    exits first or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"sloserve serve exited with {proc.returncode} during "
                               f"startup:\n{log()}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"sloserve serve not healthy after {timeout_s} s:\n{log()}")
        time.sleep(poll_s)


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (the server stops its EngineCore and workers itself); past the timeout, SIGKILL
    for it and every process under it, so that no orphan outlives a benchmark."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        import psutil

        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            child.kill()
        proc.kill()
        proc.wait()


@contextmanager
def serve(policy: PolicySpec, budget: int, model: str, startup_timeout_s: float = 300.0,
          log_path: str | Path | None = None, log_header: str = "",
          **engine_overrides: Any) -> Iterator[str]:
    """Yields the base URL of a server running `policy` at `budget`; stops it afterwards. With
    `log_path`, the server's info-level log is appended there (after `log_header`'s line)."""
    port = free_port()
    args = [sys.executable, "-m", "engine", "serve", "--model", model, "--port", str(port),
            "--max-num-batched-tokens", str(budget),
            "--log-level", "info" if log_path is not None else "warning",
            *policy.serve_args()]
    for key, value in engine_overrides.items():
        if key == "enable_prefix_caching":
            args += [] if value else ["--no-prefix-caching"]
            continue
        if key == "enforce_eager":
            args += ["--enforce-eager"] if value else []
            continue
        if key not in _FLAGS:
            raise ValueError(f"engine setting {key!r} has no `sloserve serve` flag")
        if value is not None:
            args += [_FLAGS[key], str(value)]
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")  # noqa: SIM115 - closed in the finally below
        log.write(f"== sloserve serve: policy {policy.name}, budget {budget}"
                  f"{', ' + log_header if log_header else ''} ==\n".encode())
        log.flush()
        start_offset = log.tell()
    else:
        log = tempfile.TemporaryFile()
        start_offset = 0
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"

    def log_tail() -> str:
        # This server's part of the log only (an appended file holds the earlier ones too).
        if log_path is not None:
            with open(log_path, "rb") as f:
                f.seek(start_offset)
                return f.read().decode(errors="replace")[-3000:]
        log.seek(0)
        return log.read().decode(errors="replace")[-3000:]

    try:
        wait_until_healthy(proc, url, startup_timeout_s, log_tail)
        yield url
    finally:
        stop_server(proc)
        log.close()
