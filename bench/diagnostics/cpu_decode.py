"""A CPU decode step against HF transformers' per-token decode, side by side in one process.

Builds the default model (or ``--model``) as one ``LLM`` per variant of the engine's CPU kernel
switches, and HF transformers' model in float32 (its fastest dtype on a CPU without native
bf16 arithmetic), then for each CONCURRENCYxCONTEXT configuration times, in alternating order:

- the engine's decode-only iteration (``step_profile.run_config``: ms a loop iteration of
  the ``LLM``, the forward in brackets; medians over the decode steps), and
- HF's decode: the same prompts prefilled once, then greedy tokens one at a time through
  ``model(..., past_key_values=...)``, ms per token (median over the tokens).

Prints each variant's time over HF's for every configuration, and the engines' output checksums
(variants of the kernels must not change a token).

    python -m bench.diagnostics.cpu_decode                   # 1x512 and 8x512, each variant
    python -m bench.diagnostics.cpu_decode --configs 1x512 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.diagnostics.step_profile import _prompts, run_config

# Engine variants: the environment each LLM is built under (the switches are read at load).
VARIANTS: dict[str, dict[str, str]] = {
    "float32 weights": {"SLOSERVE_CPU_BF16_WEIGHTS": "0"},
    "bf16 copies": {"SLOSERVE_CPU_BF16_WEIGHTS": "auto", "SLOSERVE_CPU_DECODE_PASS": "0"},
    "decode pass": {"SLOSERVE_CPU_BF16_WEIGHTS": "auto", "SLOSERVE_CPU_DECODE_PASS": "1"},
}


def hf_decode_ms(model, prompts: list[list[int]], tokens: int) -> float:
    """Median ms per greedy token of HF's cached decode after one prefill of ``prompts``."""
    ids = torch.tensor(prompts)
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        past = out.past_key_values
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(tokens):
            began = time.perf_counter()
            out = model(input_ids=next_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--configs", nargs="+", default=["1x512", "8x512"],
                        help="CONCURRENCYxCONTEXT decode configurations")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds over the engines and HF, order reversed every other round")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.entrypoints.default_model import model_path_or_default

    model_path = model_path_or_default(args.model)
    configs = [tuple(map(int, c.split("x"))) for c in args.configs]
    most = max(n * -(-(ctx + args.max_tokens) // 16) for n, ctx in configs)
    llms = {}
    for name, env in VARIANTS.items():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            llms[name] = LLM(model=model_path, dtype="float32", device="cpu",
                             max_num_batched_tokens=2048,
                             max_num_seqs=max(n for n, _ in configs), num_kv_blocks=most + 16,
                             max_model_len=max(ctx for _, ctx in configs) + args.max_tokens)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    hf = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    names = [*llms, "HF transformers"]
    rows = []
    try:
        for n, ctx in configs:
            times: dict[str, list[float]] = {k: [] for k in names}
            forwards: dict[str, list[float]] = {k: [] for k in llms}
            checksums: dict[str, int] = {}
            prompts = _prompts(hf.config.vocab_size, n, ctx, seed=0)
            for rep in range(args.repeats):
                for name in names if rep % 2 == 0 else names[::-1]:
                    if name in llms:
                        result = run_config(llms[name], n, ctx, args.max_tokens, 1, False)
                        times[name].append(result["iteration"])
                        forwards[name].append(result["forward"] + result["lm_head"])
                        checksums[name] = result["output_checksum"]
                    else:
                        times[name].append(hf_decode_ms(hf, prompts, args.max_tokens))
            median = {k: statistics.median(v) for k, v in times.items()}
            row = {"config": f"{n}x{ctx}", "ms": {k: round(v, 2) for k, v in median.items()},
                   "forward_ms": {k: round(statistics.median(v), 2) for k, v in forwards.items()},
                   "over_hf": {k: round(median[k] / median["HF transformers"], 3) for k in llms},
                   "checksums": checksums}
            rows.append(row)
            print(f"{n}x{ctx}: " + "  ".join(
                f"{k} {median[k]:.2f} ms" + (f" ({row['forward_ms'][k]:.2f}) = "
                                             f"{row['over_hf'][k]:.2f}x HF" if k in llms else "")
                for k in names) + f"  checksums {sorted(set(checksums.values()))}", flush=True)
    finally:
        for llm in llms.values():
            llm.shutdown()
    print(json.dumps({"torch_threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
                      "repeats": args.repeats, "configs": rows}, indent=1))


if __name__ == "__main__":
    main()
