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
                   max_tokens: int) -> dict:
    from engine import LLM, SamplingParams

    longest = max(map(len, prefill_prompts))
    llm = LLM(model=model_dir, dtype=dtype, enable_prefix_caching=False,
              max_num_batched_tokens=max(2048, longest), max_num_seqs=len(decode_prompts))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": prefill_prompts[0]}, one)  # warm-up
    started = time.perf_counter()
    for p in prefill_prompts:
        llm.generate({"prompt_token_ids": p}, one)
    prefill_s = time.perf_counter() - started

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in decode_prompts], params)
    decode_s = time.perf_counter() - started
    assert all(len(o.token_ids) == max_tokens for o in outs)
    return {
        "prefill_tokens_per_s": sum(map(len, prefill_prompts)) / prefill_s,
        "decode_tokens_per_s": len(decode_prompts) * max_tokens / decode_s,
        "decode_requests": len(decode_prompts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-decode-requests", type=int, default=4,
                        help="HF generate runs this many of the requests one at a time")
    args = parser.parse_args()

    from engine.model_setup import load_hf_config

    model_dir = args.model
    if model_dir is None:
        from engine.default_model import default_model_path

        model_dir = str(default_model_path())
    vocab = load_hf_config(model_dir).vocab_size
    prefill = _prompts(vocab, args.prefill_prompts, args.prefill_len, seed=0)
    decode = _prompts(vocab, args.concurrency, args.decode_prompt_len, seed=1)
    torch_dtype = getattr(torch, args.dtype)

    ours = bench_sloserve(model_dir, args.dtype, prefill, decode, args.max_tokens)
    hf = bench_hf(model_dir, torch_dtype, prefill, decode[: args.hf_decode_requests],
                  args.max_tokens)
    result = {
        "model": model_dir, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "prefill_len": args.prefill_len, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "sloserve": ours, "hf": hf,
        "prefill_ratio": ours["prefill_tokens_per_s"] / hf["prefill_tokens_per_s"],
        "decode_ratio": ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"],
        "targets": {"prefill_ratio": 1.0, "decode_ratio": 3.0},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
