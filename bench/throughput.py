"""Throughput: sloserve vs HF transformers on the same model, dtype and machine, in one run.

Prefill: tokens/s of a forward pass over whole prompts (HF: `model(input_ids)`; sloserve: a
request with max_tokens=1, prefix caching off so nothing is reused).
Decode: output tokens/s with N concurrent requests in sloserve vs HF `generate` one request at a
time (the way a plain HF script serves). Prints one JSON object with both and their ratios.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Avoid the lowest ids (special tokens) so no prompt contains an EOS.
    return torch.randint(100, vocab, (count, length), generator=g).tolist()


def bench_hf(model_dir: str, dtype: torch.dtype, prefill_prompts, decode_prompts,
             max_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
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
    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, longest), max_num_seqs=len(decode_prompts),
              tensor_parallel_size=tensor_parallel_size)
    steps = _record_step_times(llm)
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


def _record_step_times(llm) -> list[tuple[float, float]]:
    """(wall time of executor.execute_model, rank 0's transport time) for every step."""
    times: list[tuple[float, float]] = []
    execute = llm.engine.executor.execute_model

    def timed(scheduler_output):
        started = time.perf_counter()
        out = execute(scheduler_output)
        times.append((time.perf_counter() - started, out.transport_seconds))
        return out

    llm.engine.executor.execute_model = timed
    return times


def make_random_model(folder: str, like: str, num_heads: int, num_kv_heads: int) -> str:
    """A random-weight copy of `like`'s shape with another head count (the default model's 9
    heads cannot be split over 2 ranks); for measuring TP overhead, not output quality."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(like)
    config.num_attention_heads, config.num_key_value_heads = num_heads, num_kv_heads
    config.head_dim = config.hidden_size // num_heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
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
    args = parser.parse_args()

    from engine.runtime.model_setup import load_hf_config

    model_dir = args.model
    if model_dir is None:
        from engine.entrypoints.default_model import default_model_path

        model_dir = str(default_model_path())
    if args.random_heads:
        import tempfile

        folder = tempfile.mkdtemp(prefix="sloserve-bench-")
        model_dir = make_random_model(folder, model_dir, *args.random_heads)
    vocab = load_hf_config(model_dir).vocab_size
    prefill = _prompts(vocab, args.prefill_prompts, args.prefill_len, seed=0)
    decode = _prompts(vocab, args.concurrency, args.decode_prompt_len, seed=1)
    if args.dtype == "auto":
        from engine.runtime.model_setup import auto_dtype

        args.dtype = str(auto_dtype(torch.device("cpu"))[0]).removeprefix("torch.")
    torch_dtype = getattr(torch, args.dtype)

    ours = [bench_sloserve(model_dir, args.dtype, prefill, decode, args.max_tokens, tp)
            for tp in args.tensor_parallel_size]
    hf = bench_hf(model_dir, torch_dtype, prefill, decode[: args.hf_decode_requests],
                  args.max_tokens)
    result = {
        "model": model_dir, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prefill_len": args.prefill_len, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "sloserve": ours, "hf": hf,
        "prefill_ratio": [r["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"] for r in ours],
        "decode_ratio": [r["decode_tokens_per_s"] / hf["decode_tokens_per_s"] for r in ours],
        "targets": {"prefill_ratio": 1.0, "decode_ratio": 3.0},
    }
    if len(ours) > 1:
        base = ours[0]
        result["tp_vs_first"] = {
            f"tp{r['tensor_parallel_size']}": {
                "prefill_speed_ratio": r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"],
                "decode_speed_ratio": r["decode_tokens_per_s"] / base["decode_tokens_per_s"],
            } for r in ours[1:]}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
