"""Overhead of the HTTP/IPC path: the same requests through the offline engine and through
`sloserve serve` with streaming, side by side in one run.

Two phases, each run on both paths:
- sequential: one request at a time; per-request latency (arrival to last token, measured at the
  client for HTTP) isolates the per-request cost of HTTP, tokenization, IPC and SSE.
- concurrent: all requests at once; output tokens/s compares throughput.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch


def _prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, vocab, (count, length), generator=g).tolist()


def offline(model: str, dtype: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, params)  # warm-up
    latencies = []
    for p in prompts:
        started = time.perf_counter()
        llm.generate({"prompt_token_ids": p}, params)
        latencies.append(time.perf_counter() - started)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - started
    llm.shutdown()
    return {"latencies": latencies, "tokens_per_s": len(prompts) * max_tokens / elapsed}


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    started = time.perf_counter()
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += 1
    assert tokens > 0
    return time.perf_counter() - started


async def over_http(base_url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await _stream(client, prompts[0], max_tokens)  # warm-up
        latencies = [await _stream(client, p, max_tokens) for p in prompts]
        started = time.perf_counter()
        await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - started
    return {"latencies": latencies, "tokens_per_s": len(prompts) * max_tokens / elapsed}


def start_server(model: str, dtype: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", model, "--dtype", dtype,
           "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(cmd)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with code {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("server did not become healthy in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from engine.default_model import model_path_or_default
    from engine.model_setup import load_hf_config

    model = model_path_or_default(args.model)
    prompts = _prompts(load_hf_config(model).vocab_size, args.requests, args.prompt_len)
    ours = offline(model, args.dtype, prompts, args.max_tokens)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(model, args.dtype, port)
    try:
        http = asyncio.run(over_http(f"http://127.0.0.1:{port}", prompts, args.max_tokens))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)

    overheads = [h - o for h, o in zip(http["latencies"], ours["latencies"])]
    result = {
        "model": model, "dtype": args.dtype, "requests": args.requests,
        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "cpu_count": os.cpu_count(),
        "sequential_latency_ms": {
            "offline_median": 1000 * statistics.median(ours["latencies"]),
            "http_median": 1000 * statistics.median(http["latencies"]),
            "overhead_median": 1000 * statistics.median(overheads),
            "overhead_p90": 1000 * statistics.quantiles(overheads, n=10)[-1],
        },
        "concurrent_tokens_per_s": {"offline": ours["tokens_per_s"], "http": http["tokens_per_s"],
                                    "http_loss_pct": 100 * (1 - http["tokens_per_s"]
                                                            / ours["tokens_per_s"])},
        "targets": {"overhead_median_ms": 5.0, "http_loss_pct": 3.0},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
