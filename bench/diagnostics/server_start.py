"""How long `sloserve serve` takes to answer /health, and where the time goes.

Starts the server `--repeats` times, one after the other, and times from the command's start to
three moments the client can see: uvicorn's lifespan starting (the API server has checked the
configuration and loaded its tokenizer: "Waiting for application startup."), EngineCore's first
line after it (the engine building), and /health answering 200. Prints one JSON object with
each run's times and their medians.

    python -m bench.diagnostics.server_start --model DIR --repeats 4
    python -m bench.diagnostics.server_start -- --dtype float32 --max-model-len 512

Arguments after `--` go to `sloserve serve` as they are. Served on the default model without
--model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time

from engine.benchmarks.server import serve_command, wait_until_healthy
from engine.ports import free_port

LIFESPAN_LINE = "Waiting for application startup."
ENGINE_LOGGER = "sloserve-engine-core"


def time_one_start(serve_args: list[str], timeout_s: float = 300.0) -> dict[str, float | None]:
    port = free_port()
    started = time.monotonic()
    marks: dict[str, float | None] = {"lifespan_s": None, "engine_built_s": None}
    lines: list[str] = []  # the server's output, quoted if it fails to start
    proc = subprocess.Popen(serve_command(*serve_args, port=port), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            now = round(time.monotonic() - started, 3)
            if marks["lifespan_s"] is None and LIFESPAN_LINE in line:
                marks["lifespan_s"] = now
            elif (marks["lifespan_s"] is not None and marks["engine_built_s"] is None
                  and ENGINE_LOGGER in line):
                marks["engine_built_s"] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}", timeout_s, lambda: "".join(lines),
                           poll_s=0.02)
        healthy = time.monotonic() - started
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    return {**marks, "healthy_s": round(healthy, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the default model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("serve_args", nargs="*", help="after --: more `sloserve serve` arguments")
    args = parser.parse_args(argv)
    serve_args = ([] if args.model is None else ["--model", args.model]) + args.serve_args
    runs = [time_one_start(serve_args) for _ in range(args.repeats)]

    def median(key: str) -> float | None:
        values = [run[key] for run in runs if run[key] is not None]
        return round(statistics.median(values), 3) if values else None

    print(json.dumps({"serve_args": serve_args, "runs": runs,
                      "median": {key: median(key) for key in runs[0]}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
