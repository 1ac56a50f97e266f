"""The first requests after startup: does any stream stall on a first-use kernel compile?

A fresh `sloserve serve` gets one streamed request at each context length in turn, the first
the server ever sees at that length, then a second one at the same length. Chunk arrival times
are the client's. The second request's median gap between chunks is the decode step at that
context; the first request passes when none of its gaps exceeds twice that step (a new
decode-attention variant once compiled for about a second mid-stream).

    sloserve bench shape llama-3.1-8b /tmp/llama-8b
    python -m bench.e2e.stream_gaps --model /tmp/llama-8b --load-format dummy --output gaps.json

With --output PATH: the JSON at the end; as the run goes, PATH's .jsonl twin (`gaps.jsonl`,
engine/benchmarks/measure/figures.py) gets `run` (model, contexts), `startup` (server start to healthy, the
log's
warm-up lines), a `row` per context as soon as both its requests are measured, and `done`; and
the server's own log, at info level, goes to `gaps.server.log` beside it as the server writes
it (not only on a failure), so a run killed at its time limit leaves both. Without --output the
server's log is a temporary file, quoted only if the server fails to start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.suite import dry_run
from engine.benchmarks.server import launched_server, serve_command
from engine.ports import free_port
from engine.benchmarks.measure.figures import FigureLog, jsonl_twin

# A gap is a stall when it is over this multiple of the warm decode step.
STALL_MULTIPLE = 2.0


def _stream(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion: the client's TTFT and the gaps between chunks carrying text."""
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    sent = time.monotonic()
    with httpx.Client(base_url=url, timeout=600) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"the server failed the request: {chunk['error']}")
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    times.append(time.monotonic())
    if not times:
        raise RuntimeError("the stream carried no text")
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return {"ttft_ms": round((times[0] - sent) * 1000, 2),
            "gaps_ms": [round(g, 2) for g in gaps]}


def server_log_path(out: str | Path) -> Path:
    """Where the server's log goes beside the JSON: `gaps.json` -> `gaps.server.log`."""
    return Path(out).with_suffix(".server.log")


def measure(url: str, contexts: list[int], max_tokens: int, vocab: int,
            log: FigureLog | None = None) -> list[dict[str, Any]]:
    """A row per context, each written to `log` as soon as it is measured."""
    import random

    rng = random.Random(0)
    rows = []
    for context in contexts:
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        first = _stream(url, prompt, max_tokens)
        # Another prompt of the same length: no prefix-cache hit on the first one.
        warm = _stream(url, [rng.randrange(100, vocab) for _ in range(context)], max_tokens)
        step_ms = statistics.median(warm["gaps_ms"]) if warm["gaps_ms"] else None
        worst = max(first["gaps_ms"], default=0.0)
        ratio = worst / step_ms if step_ms else None
        rows.append({"context": context, "first": first, "warm": warm,
                     "decode_step_ms": step_ms, "first_max_gap_ms": worst,
                     # The same measure on the warm request: the noise floor of the host.
                     "warm_max_gap_ms": max(warm["gaps_ms"], default=0.0),
                     "max_gap_over_step": round(ratio, 2) if ratio is not None else None,
                     "stalled": ratio is not None and ratio > STALL_MULTIPLE})
        if log is not None:
            log.write("row", **rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--contexts", type=int, nargs="+", default=[16, 500, 3000, 12000])
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the server without CUDA graphs (the GPU suite's steps after a "
                             "failed capture)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more `sloserve serve` argument (repeat; e.g. "
                             "--serve-arg=--max-model-len=16384)")
    parser.add_argument("--output", default=None,
                        help="write the rows as JSON here at the end; each row as measured to "
                             "its .jsonl twin, the server's log to its .server.log twin")
    args = parser.parse_args(argv)

    from transformers import AutoConfig

    from engine.entrypoints.default_model import model_path_or_default

    model = model_path_or_default(args.model)
    vocab = AutoConfig.from_pretrained(model).vocab_size
    serve_args = ["--model", model, "--load-format", args.load_format, "--dtype", args.dtype,
                  "--max-model-len", str(max(args.contexts) + args.max_tokens + 64),
                  # Info level: the startup's warm-up and capture lines are what the report
                  # quotes.
                  "--log-level", "info",
                  *(["--device", args.device] if args.device != "auto" else []),
                  *(["--enforce-eager"] if args.enforce_eager else []), *args.serve_arg]
    if dry_run.enabled():
        # `gpu_suite.sh --dry-run`: the server, through the dry run's launcher, builds its
        # configuration and exits there.
        return subprocess.run(dry_run.launcher_command(serve_command(*serve_args,
                                                                     port=free_port())),
                              stdin=subprocess.DEVNULL,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"}).returncode
    figures = FigureLog(jsonl_twin(args.output) if args.output else None)
    figures.write("run", model=model, contexts=args.contexts, max_tokens=args.max_tokens,
                  stall_multiple=STALL_MULTIPLE)
    # With --output, the server's log in the output folder as it runs: a step killed at its time
    # limit still leaves what the server was doing.
    log_path = server_log_path(args.output) if args.output else None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_bytes(b"")
    with launched_server(serve_args, log_path=log_path,
                         startup_timeout_s=args.startup_timeout_s) as server:
        startup_s = server.startup_s
        startup_lines = [line for line in server.log_text().splitlines()
                         if "warm" in line.lower() or "compil" in line.lower()]
        figures.write("startup", startup_s=round(startup_s, 1), startup_log=startup_lines[-5:])
        rows = measure(server.url, args.contexts, args.max_tokens, vocab, figures)
        startup_lines = [line for line in server.log_text().splitlines()
                         if "warm" in line.lower() or "compil" in line.lower()]
    report = {"model": model, "startup_s": round(startup_s, 1), "stall_multiple": STALL_MULTIPLE,
              "startup_log": startup_lines[-5:], "rows": rows,
              "stalled": sum(r["stalled"] for r in rows)}
    print(f"startup_s: {report['startup_s']}")
    for line in report["startup_log"]:
        print(f"startup_log: {line.strip()}")
    print("| context | first TTFT (ms) | first max gap (ms) | warm max gap (ms) | "
          "decode step (ms) | gap / step |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['context']} | {r['first']['ttft_ms']:.1f} | {r['first_max_gap_ms']:.1f} | "
              f"{r['warm_max_gap_ms']:.1f} | {r['decode_step_ms'] or float('nan'):.1f} | "
              f"{r['max_gap_over_step']} |")
    print(f"stalled: {report['stalled']}/{len(rows)} first requests had a gap over "
          f"{STALL_MULTIPLE:g}x the decode step")
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    else:
        os.unlink(log_path)
    figures.write("done", stalled=report["stalled"])
    figures.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
