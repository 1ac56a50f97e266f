"""`sloserve serve` as a benchmark starts it: a subprocess on a free loopback port, healthy before
the benchmark sends anything, stopped with SIGTERM afterwards (SIGKILL for it and its children
past a timeout, so that no EngineCore or worker outlives a benchmark). Every benchmark that needs
a server starts it here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.ports import free_port

# The repository root (or site-packages): a script run from bench/ would otherwise put bench/ first
# on the server's sys.path, where bench/kernels/gpu_kernels.py shadows the `kernels` package.
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float  # from the process's start to its first healthy answer

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def serve_command(*serve_args: str, port: int) -> list[str]:
    """The command line of `sloserve serve` on 127.0.0.1:`port` with `serve_args`."""
    return [sys.executable, "-m", "engine", "serve", "--host", "127.0.0.1", "--port", str(port),
            *serve_args]


@contextmanager
def launched_server(serve_args: list[str], *, log_path: str | Path | None = None,
                    log_header: str | None = None, startup_timeout_s: float = 600.0,
                    env: dict[str, str] | None = None) -> Iterator[Server]:
    """Yields a healthy `sloserve serve` started with ``serve_args``; stops it on exit.

    The server's output goes to ``log_path`` as it writes it (appended, after ``log_header``'s
    line when given), so a benchmark killed mid-run still leaves what the server was doing;
    without a path, to a temporary file, quoted in the error when the server fails to start."""
    temporary = log_path is None
    if log_path is None:
        descriptor, name = tempfile.mkstemp(prefix="sloserve-server-", suffix=".log")
        os.close(descriptor)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with open(log_path, "ab") as log:
        if log_header is not None:
            log.write(f"== {log_header} ==\n".encode())
            log.flush()
        start_offset = log.tell()

        def own_log() -> str:  # this server's part of the file
            with open(log_path, "rb") as f:
                f.seek(start_offset)
                return f.read().decode(errors="replace")[-3000:]

        started = time.monotonic()
        proc = subprocess.Popen(serve_command(*serve_args, port=port), cwd=_PROJECT_ROOT,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                                     **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until_healthy(proc, url, startup_timeout_s, own_log)
            yield Server(url, proc, log_path, time.monotonic() - started)
        finally:
            stop_server(proc)
            if temporary:
                log_path.unlink(missing_ok=True)


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
    for it and every process under it."""
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
