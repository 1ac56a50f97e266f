"""`sloserve bench throughput`: sloserve vs HF transformers on the same model, dtype and
machine, in one run.

Prefill: tokens/s of a forward pass over whole prompts (HF: `model(input_ids)`; sloserve: a
request with max_tokens=1, prefix caching off so nothing is reused).
Decode: output tokens/s with N concurrent requests in sloserve vs HF `generate` one request at a
time (the way a plain HF script serves). Prints one JSON object with both and their ratios.

Roofline (engine/benchmarks/measure/roofline.py): the same run measures this machine's matmul
GFLOP/s on the model's own GEMM shapes and its memory bandwidth, then prints the engine's
prefill tokens/s (one-step prefills of --prefill-lens tokens) as a share of the linear-layer and
the full (with attention) compute bound, and its decode tokens/s (--decode-batches x
--decode-contexts) as a share of the bandwidth bound (weights once per step + each request's
K/V) and of the roofline (the larger of memory and compute time). Each size's bound is measured
right after the engine ran it, so both see the same machine load. Decode requests of one context
share all but their last 16 prompt tokens through prefix caching, so the setup prefill is not
repeated per request; each request's K/V is still gathered and read on its own every step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from engine.benchmarks.measure.figures import print_result
from engine.benchmarks.inputs.random_prompts import random_prompts
from engine.benchmarks.standalone import standalone_main
from engine.benchmarks.measure.step_log import decode_seconds_per_step, record_step_times, record_steps


def bench_hf(model_dir: str, dtype: torch.dtype, prefill_prompts, decode_prompts,
             max_tokens: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.benchmarks.reference.hf_reference import fastest_attention

    attention = fastest_attention(AutoConfig.from_pretrained(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                 attn_implementation=attention)
    model.eval()
    with torch.inference_mode():
        model(torch.tensor([prefill_prompts[0]]))  # warm-up
        started = time.perf_counter()
        for p in prefill_prompts:
            model(torch.tensor([p]))
        prefill_s = time.perf_counter() - started

        def gen(p, n):
            return model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)

        gen(decode_prompts[0], 4)  # warm-up
        started = time.perf_counter()
        for p in decode_prompts:
            gen(p, max_tokens)
        decode_s = time.perf_counter() - started
    return {
        "prefill_tokens_per_s": sum(map(len, prefill_prompts)) / prefill_s,
        "decode_tokens_per_s": len(decode_prompts) * max_tokens / decode_s,
        "decode_requests": len(decode_prompts),
    }


def bench_sloserve(model_dir: str, dtype: str, prefill_prompts, decode_prompts,
                   max_tokens: int, tensor_parallel_size: int = 1) -> dict:
    from engine import LLM, SamplingParams

    longest = max(map(len, prefill_prompts))
    # The CPU, as the HF side and the roofline: not what --device auto picks on a GPU machine.
    llm = LLM(model=model_dir, dtype=dtype, device="cpu", enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, longest), max_num_seqs=len(decode_prompts),
              tensor_parallel_size=tensor_parallel_size)
    steps = record_step_times(llm)
    try:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate({"prompt_token_ids": prefill_prompts[0]}, one)  # warm-up
        steps.clear()
        started = time.perf_counter()
        for p in prefill_prompts:
            llm.generate({"prompt_token_ids": p}, one)
        prefill_s = time.perf_counter() - started
        prefill_steps = list(steps)

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in decode_prompts], params)
        decode_s = time.perf_counter() - started
        assert all(len(o.token_ids) == max_tokens for o in outs)
    finally:
        llm.shutdown()
    step_ms = 1000 * sum(wall for wall, _ in prefill_steps) / len(prefill_steps)
    transport_ms = 1000 * sum(t for _, t in prefill_steps) / len(prefill_steps)
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "prefill_tokens_per_s": sum(map(len, prefill_prompts)) / prefill_s,
        "decode_tokens_per_s": len(decode_prompts) * max_tokens / decode_s,
        "decode_requests": len(decode_prompts),
        "prefill_step_ms": step_ms,
        "step_transport_ms": transport_ms,
        "step_transport_pct_of_prefill_step": 100 * transport_ms / step_ms,
    }


def _progress(line: str) -> None:
    # stderr, so stdout stays one JSON object; a long run shows where it is.
    print(line, file=sys.stderr, flush=True)


def bench_roofline(model_dir: str, dtype: str, prefill_lens: list[int], batches: list[int],
                   contexts: list[int], decode_tokens: int, repeats: int,
                   bandwidth_mib: int) -> dict:
    """The engine's prefill and decode tokens/s beside this machine's bounds for the model."""
    from engine.benchmarks.measure.roofline import ModelShape, Roofline, measure_bandwidth
    from engine import LLM, SamplingParams
    from engine.runtime.model_setup import cpu_native_bf16, load_hf_config

    hf_config = load_hf_config(model_dir)
    shape = ModelShape.from_hf_config(hf_config)
    torch_dtype = getattr(torch, dtype)
    dtype_bytes = torch.empty((), dtype=torch_dtype).element_size()
    roofline = Roofline(shape, torch_dtype)
    tail = 16  # distinct prompt tokens per decode request; the rest is a shared cached prefix
    llm = LLM(model=model_dir, dtype=dtype, device="cpu", enable_prefix_caching=True,
              max_num_batched_tokens=max([2048, *prefill_lens, max(batches) * tail]),
              max_num_seqs=max(batches),
              max_model_len=max([*prefill_lens, *contexts]) + decode_tokens + 1)
    steps = record_steps(llm)
    prompt_seed = iter(range(100, 10**6))
    prefill: dict[str, dict] = {}
    decode: dict[str, dict] = {}
    try:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        for length in prefill_lens:
            # Fresh random prompts every time, so prefix caching never reuses one.
            prompts = random_prompts(shape.vocab, repeats + 1, length, seed=next(prompt_seed))
            llm.generate({"prompt_token_ids": prompts[0]}, one)  # warm-up at this size
            times, step_counts = [], []
            for p in prompts[1:]:
                steps.clear()
                started = time.perf_counter()
                llm.generate({"prompt_token_ids": p}, one)
                times.append(time.perf_counter() - started)
                step_counts.append(len(steps))
            engine_tps = length / statistics.median(times)
            bound = roofline.prefill_bound(length)
            _progress(f"prefill {length}: engine {engine_tps:.0f} tok/s, linear roofline "
                      f"{bound['linear_roofline_tokens_per_s']:.0f} tok/s")
            prefill[str(length)] = {
                "engine_tokens_per_s": engine_tps, "engine_steps": max(step_counts), **bound,
                "linear_roofline_share": engine_tps / bound["linear_roofline_tokens_per_s"],
                "full_roofline_share": engine_tps / bound["full_roofline_tokens_per_s"]}
        bandwidth = measure_bandwidth(bandwidth_mib)
        for ctx in contexts:
            shared = random_prompts(shape.vocab, 1, max(ctx - tail, 1), seed=next(prompt_seed))[0]
            llm.generate({"prompt_token_ids": shared + [100]}, one)  # caches the shared blocks
            for batch in batches:
                tails = random_prompts(shape.vocab, batch, ctx - len(shared),
                                       seed=next(prompt_seed))
                params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
                steps.clear()
                llm.generate([{"prompt_token_ids": shared + t} for t in tails], params)
                prefill_tokens = sum(n for s in steps for _, n in s["requests"] if n > 1)
                step_s, step_contexts, measured = decode_seconds_per_step(steps, batch)
                engine_tps = batch / step_s
                bound = roofline.decode_bound(step_contexts, bandwidth["bandwidth_gbs"],
                                              dtype_bytes)
                _progress(f"decode {batch} x {ctx}: engine {engine_tps:.1f} tok/s, bandwidth bound "
                          f"{bound['bandwidth_bound_tokens_per_s']:.1f} tok/s")
                decode.setdefault(str(batch), {})[str(ctx)] = {
                    "engine_tokens_per_s": engine_tps, "engine_step_ms": 1000 * step_s,
                    "steps_measured": measured, "mean_context": step_contexts[0],
                    "setup_prefill_tokens": prefill_tokens, **bound,
                    "bandwidth_share": engine_tps / bound["bandwidth_bound_tokens_per_s"],
                    "roofline_share": engine_tps / bound["roofline_tokens_per_s"]}
    finally:
        llm.shutdown()
    native_bf16, why = cpu_native_bf16()
    limits = {"dtype": dtype, "threads": torch.get_num_threads(),
              "matmul_gflops": {n: v["matmul_gflops"] for n, v in prefill.items()},
              "attention_gflops": {n: v["attention_gflops"] for n, v in prefill.items()},
              "matmul_gflops_peak": roofline.peak_gflops(), **bandwidth,
              "bf16_native": native_bf16, "bf16_why": why,
              "linear_params": shape.linear_params, "lm_head_params": shape.lm_head_params,
              "kv_bytes_per_token": shape.kv_bytes_per_token(dtype_bytes)}
    if native_bf16 and torch_dtype != torch.bfloat16:
        # Emulated bf16 is ~100x slower: measured only where the CPU runs it natively.
        limits["bf16_matmul_gflops_peak"] = Roofline(shape, torch.bfloat16).peak_gflops()
    return {"roofline": limits, "prefill": prefill, "decode": decode}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                        help="auto: bfloat16 where this CPU runs it natively, else float32")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-decode-requests", type=int, default=4,
                        help="HF generate runs this many of the requests one at a time")
    parser.add_argument("--tensor-parallel-size", type=int, nargs="+", default=[1],
                        help="one or more TP sizes, measured one after another in this run")
    parser.add_argument("--random-heads", type=int, nargs=2, metavar=("HEADS", "KV_HEADS"),
                        help="bench a random-weight model of the model's shape with these head "
                             "counts (e.g. 8 2, so that TP=2 is possible)")
    roof = parser.add_argument_group("roofline")
    roof.add_argument("--prefill-lens", type=int, nargs="+", default=[128, 512, 2048, 4096],
                      help="prompt lengths of the roofline prefill figures")
    roof.add_argument("--decode-batches", type=int, nargs="+", default=[1, 16, 64],
                      help="concurrent requests of the roofline decode figures")
    roof.add_argument("--decode-contexts", type=int, nargs="+", default=[64, 2000],
                      help="prompt (context) lengths of the roofline decode figures")
    roof.add_argument("--decode-tokens", type=int, default=8,
                      help="tokens generated per decode request (all but the first are timed)")
    roof.add_argument("--repeats", type=int, default=3, help="timed prefills per prompt length")
    roof.add_argument("--bandwidth-mib", type=int, default=1024,
                      help="buffer size of the bandwidth measurement (far past the caches)")
    roof.add_argument("--quick", action="store_true",
                      help="prefill 128 512, decode 1 16 over 64 tokens, one timed repeat")
    roof.add_argument("--no-roofline", action="store_true", help="only the HF comparison")
    roof.add_argument("--no-hf", action="store_true", help="only the roofline figures")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write the JSON object printed at the end here")


def run(args: argparse.Namespace) -> int:
    """`sloserve bench throughput`: measure and print one JSON object."""
    if args.quick:
        args.prefill_lens, args.decode_batches, args.decode_contexts = [128, 512], [1, 16], [64]
        args.repeats = 1
    wall_started = time.perf_counter()

    from engine.runtime.model_setup import load_hf_config

    model_dir = args.model
    if model_dir is None:
        from engine.entrypoints.default_model import default_model_path

        model_dir = str(default_model_path())
    if args.random_heads:
        import tempfile

        from engine.benchmarks.inputs.random_checkpoints import random_with_heads

        folder = tempfile.mkdtemp(prefix="sloserve-bench-")
        model_dir = random_with_heads(folder, model_dir, *args.random_heads)
    vocab = load_hf_config(model_dir).vocab_size
    prefill = random_prompts(vocab, args.prefill_prompts, args.prefill_len, seed=0)
    decode = random_prompts(vocab, args.concurrency, args.decode_prompt_len, seed=1)
    if args.dtype == "auto":
        from engine.runtime.model_setup import auto_dtype

        args.dtype = str(auto_dtype(torch.device("cpu"))[0]).removeprefix("torch.")
    torch_dtype = getattr(torch, args.dtype)

    result: dict = {"model": model_dir, "dtype": args.dtype, "threads": torch.get_num_threads(),
                    "load_average_at_start": os.getloadavg()[0]}
    if not args.no_roofline:
        result.update(bench_roofline(model_dir, args.dtype, args.prefill_lens,
                                     args.decode_batches, args.decode_contexts,
                                     args.decode_tokens, args.repeats, args.bandwidth_mib))
        result["roofline_targets"] = {"prefill_512_linear_roofline_share": 0.85,
                                      "decode_16x64_bandwidth_share": 0.50,
                                      "decode_16x2000_bandwidth_share": 0.35}
    ours = [] if args.no_hf else [
        bench_sloserve(model_dir, args.dtype, prefill, decode, args.max_tokens, tp)
        for tp in args.tensor_parallel_size]
    if not args.no_hf:
        hf = bench_hf(model_dir, torch_dtype, prefill, decode[: args.hf_decode_requests],
                      args.max_tokens)
        result.update({
            "prefill_len": args.prefill_len, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "sloserve": ours, "hf": hf,
            "prefill_ratio": [r["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"] for r in ours],
            "decode_ratio": [r["decode_tokens_per_s"] / hf["decode_tokens_per_s"] for r in ours],
            "targets": {"prefill_ratio": 1.0, "decode_ratio": 3.0},
        })
    result["wall_s"] = time.perf_counter() - wall_started
    result["load_average_at_end"] = os.getloadavg()[0]
    if len(ours) > 1:
        base = ours[0]
        result["tp_vs_first"] = {
            f"tp{r['tensor_parallel_size']}": {
                "prefill_speed_ratio": r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"],
                "decode_speed_ratio": r["decode_tokens_per_s"] / base["decode_tokens_per_s"],
            } for r in ours[1:]}
    print_result(result, args.output)
    return 0


def main(argv: list[str] | None = None) -> int:
    """As a script (bench/e2e/): the same options as the subcommand."""
    return standalone_main(__doc__, add_arguments, run, argv)
