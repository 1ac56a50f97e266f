"""`sloserve bench serve`, the overhead of the HTTP/IPC path: the same requests through the
offline engine and through `sloserve serve` with streaming, side by side in one run.

Two phases, each run on both paths:
- sequential: one request at a time, offline and HTTP alternating; per-request latency (to the
  last token, measured at the client for HTTP) isolates the cost of HTTP, IPC and SSE.
- concurrent: all requests at once, offline and HTTP batches alternating; output tokens/s.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from tqdm import tqdm

from engine.benchmarks.measure.figures import print_result
from engine.benchmarks.inputs.random_prompts import random_prompts
from engine.benchmarks.server import launched_server
from engine.benchmarks.standalone import standalone_main


def _stream_sync(client: httpx.Client, prompt: list[int], max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass
    return time.perf_counter() - started


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.aiter_lines():
            pass


async def _http_batch(base_url: str, prompts: list[list[int]], max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))
        return time.perf_counter() - started


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _server_steps(base_url: str) -> int:
    return httpx.get(f"{base_url}/debug/stats").json()["num_steps"]


def measure(model: str, dtype: str, base_url: str, prompts: list[list[int]], max_tokens: int,
            rounds: int, sequential: int, server_pid: int) -> dict:
    """Offline and HTTP alternate request by request (and batch by batch), so the drift of a
    shared machine falls on both alike."""
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    offline_lat, http_lat = [], []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        llm.generate({"prompt_token_ids": prompts[0]}, params)  # warm-up, both paths
        _stream_sync(client, prompts[0], max_tokens)
        for p in tqdm(prompts[:sequential], desc="sequential"):
            started = time.perf_counter()
            llm.generate({"prompt_token_ids": p}, params)
            offline_lat.append(time.perf_counter() - started)
            http_lat.append(_stream_sync(client, p, max_tokens))
    offline_s, http_s = [], []
    batch = [{"prompt_token_ids": p} for p in prompts]
    # Where the CPU goes during the HTTP batches: on a small machine the API server (and this
    # load generator) compete with EngineCore for the same cores.
    core_pid = _children(server_pid)[-1]
    cpu = {"api_server": 0.0, "engine_core": 0.0, "load_client": 0.0}
    steps = {"offline": 0.0, "http": 0.0}
    for _ in tqdm(range(rounds), desc="concurrent"):
        first_step = llm.engine.scheduler.step_id
        started = time.perf_counter()
        llm.generate(batch, params)
        offline_s.append(time.perf_counter() - started)
        steps["offline"] += (llm.engine.scheduler.step_id - first_step) / rounds
        first_step = _server_steps(base_url)
        before = (_cpu_seconds(server_pid), _cpu_seconds(core_pid), time.process_time())
        http_s.append(asyncio.run(_http_batch(base_url, prompts, max_tokens)))
        after = (_cpu_seconds(server_pid), _cpu_seconds(core_pid), time.process_time())
        steps["http"] += (_server_steps(base_url) - first_step) / rounds
        for key, b, a in zip(cpu, before, after):
            cpu[key] += (a - b) / rounds
    llm.shutdown()
    tokens = len(prompts) * max_tokens
    return {"offline_latencies": offline_lat, "http_latencies": http_lat,
            "offline_tokens_per_s": tokens / statistics.median(offline_s),
            "http_tokens_per_s": tokens / statistics.median(http_s),
            "http_batch_seconds": statistics.median(http_s), "http_batch_cpu_seconds": cpu,
            "engine_steps_per_batch": steps}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 where this CPU runs it natively, else float32")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--sequential-requests", type=int, default=None,
                        help="how many of the requests the sequential phase sends (default all)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="concurrent batches per path (the median is reported)")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the JSON object printed at the end here")


def overhead_figures(model: str, args: argparse.Namespace, m: dict) -> dict:
    """The printed JSON object: `measure`'s timings as the overhead of the HTTP path."""
    ours, http = m["offline_latencies"], m["http_latencies"]
    overheads = [h - o for h, o in zip(http, ours)]
    result = {
        "model": model, "dtype": args.dtype, "requests": args.requests,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "sequential_latency_ms": {
            "offline_median": 1000 * statistics.median(ours),
            "http_median": 1000 * statistics.median(http),
            "overhead_median": 1000 * statistics.median(overheads),
            "overhead_p90": 1000 * statistics.quantiles(overheads, n=10)[-1],
        },
        "concurrent_tokens_per_s": {
            "offline": m["offline_tokens_per_s"], "http": m["http_tokens_per_s"],
            "http_loss_pct": 100 * (1 - m["http_tokens_per_s"] / m["offline_tokens_per_s"])},
        "http_batch_wall_seconds": m["http_batch_seconds"],
        "http_batch_cpu_seconds": m["http_batch_cpu_seconds"],
        "engine_steps_per_batch": m["engine_steps_per_batch"],
        "targets": {"overhead_median_ms": 5.0, "http_loss_pct": 3.0},
    }
    return result


def run(args: argparse.Namespace) -> int:
    """`sloserve bench serve`: one JSON object, the offline engine beside the HTTP server."""
    from engine.entrypoints.default_model import model_path_or_default
    from engine.runtime.model_setup import load_hf_config

    model = model_path_or_default(args.model)
    prompts = random_prompts(load_hf_config(model).vocab_size, args.requests, args.prompt_len,
                             seed=0)
    with launched_server(["--model", model, "--dtype", args.dtype,
                          "--log-level", "warning"]) as server:
        m = measure(model, args.dtype, server.url, prompts, args.max_tokens, args.rounds,
                    args.sequential_requests or args.requests, server.process.pid)

    result = overhead_figures(model, args, m)
    print_result(result, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    """As a script (bench/e2e/): the same options as the subcommand."""
    return standalone_main(__doc__, add_arguments, run, argv)
