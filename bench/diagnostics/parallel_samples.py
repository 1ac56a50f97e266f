"""Parallel samples (n > 1): the prompt computed once, side by side with the ways it would
otherwise be computed n times, in one run on one engine configuration.

Three ways to get n samples of one long prompt on the offline engine:
  gated      SamplingParams(n=N): samples 1..N-1 wait for sample 0's prefill, then hit its
             blocks in the prefix cache (engine.core.sibling_gate);
  together   N requests of the same prompt submitted at once (seeds s+i, no gate): all are
             admitted before any block is cached, so each computes the prompt;
  no-cache   SamplingParams(n=N) with prefix caching off.
Prints one JSON object: per way, the tokens the model computed, wall seconds, the time to the
first token of the first and of the last sample, and the ratios against `gated`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _run(llm, prompt: list[int], n: int, max_tokens: int, gated: bool) -> dict:
    from engine.sampling_params import SamplingParams

    scheduler = llm.engine.scheduler
    before = scheduler.num_scheduled_tokens_total
    params = SamplingParams(n=n, temperature=0.8, seed=1, max_tokens=max_tokens,
                            ignore_eos=True)
    started = time.monotonic()
    if gated:
        (out,) = llm.generate({"prompt_token_ids": prompt}, params)
        outs = out.outputs
    else:
        outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                            [params.child(i) for i in range(n)])
    wall = time.monotonic() - started
    first_tokens = sorted(o.metrics.first_token_time - started for o in outs)
    return {"computed_tokens": scheduler.num_scheduled_tokens_total - before,
            "wall_s": round(wall, 3), "first_sample_ttft_s": round(first_tokens[0], 3),
            "last_sample_ttft_s": round(first_tokens[-1], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("-n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)

    from engine.entrypoints.llm import LLM

    results: dict[str, dict] = {}
    for way, caching, gated in (("gated", True, True), ("together", True, False),
                                ("no-cache", False, True)):
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=caching,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.prompt_len + args.max_tokens + 16)
        try:
            g = torch.Generator().manual_seed(0)
            warm = torch.randint(100, llm.engine.vocab_size, (64,), generator=g).tolist()
            _run(llm, warm, 2, 2, gated)  # warm-up (a different prompt: nothing to reuse)
            prompt = torch.randint(100, llm.engine.vocab_size, (args.prompt_len,),
                                   generator=g).tolist()
            results[way] = _run(llm, prompt, args.n, args.max_tokens, gated)
        finally:
            llm.shutdown()
    base = results["gated"]
    for way, r in results.items():
        r["computed_tokens_vs_gated"] = round(r["computed_tokens"] / base["computed_tokens"], 2)
        r["wall_vs_gated"] = round(r["wall_s"] / base["wall_s"], 2)
    print(json.dumps({"prompt_len": args.prompt_len, "n": args.n,
                      "max_tokens": args.max_tokens, **results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
