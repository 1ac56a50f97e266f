"""FP8 weights on the CPU against float32 and bf16, side by side: decode tokens/s of the engine
and the weight memory each holds.

One engine per configuration, all loaded at once with dummy weights of a real layout
(``sloserve bench shape``; fewer layers than the shape has, so four engines fit in memory and
load quickly): float32, bfloat16, and ``quantization="fp8"`` (weights quantized at load, one
scale per output channel, dequantized per layer on the CPU: workers.quantization.cpu_dequant)
computing in float32 and in bfloat16. Rounds alternate between the engines, so machine noise
hits each alike; each round decodes ``--tokens`` tokens for ``--batch`` requests after a short
prompt, and a configuration's figure is its median round. Decode time is the time from each
request's first token to its last. Prints a table, then one JSON object.

    python -m bench.diagnostics.cpu_fp8
    python -m bench.diagnostics.cpu_fp8 --shape llama-3.2-1b --layers 8 --tokens 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# (label, dtype, quantization)
CONFIGS = (("float32", "float32", None), ("bfloat16", "bfloat16", None),
           ("fp8 (float32 compute)", "float32", "fp8"), ("fp8 (bf16 compute)", "bfloat16", "fp8"))


def _weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    from workers.quantization import is_scale_name

    # Parameters, and the scales --quantization fp8 computes at load (buffers); not the rotary
    # tables, which are buffers too.
    tensors = [*model.named_parameters(),
               *((n, b) for n, b in model.named_buffers() if is_scale_name(n))]
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    linear = sum(t.numel() * t.element_size() for name, t in tensors
                 if "_proj." in name)  # the attention and MLP projections (FP8 when quantized)
    return {"total": total, "linear": linear}


def _decode_round(llm: Any, batch: int, tokens: int, prompt_len: int) -> float:
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 1 for j in range(prompt_len)]}
               for i in range(batch)]
    outputs = llm.generate(prompts, params)
    # Every request decodes `tokens` tokens after its first, in the same steps.
    first = min(o.metrics.first_token_time for o in outputs)
    last = max(o.metrics.finish_time for o in outputs)
    return batch * tokens / (last - first)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers kept")
    parser.add_argument("--tokens", type=int, default=16, help="decoded tokens a round")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                        help="another config.json field of the shape (an int), e.g. "
                             "vocab_size=32000")
    args = parser.parse_args(argv)

    from engine import LLM
    from engine.benchmarks.inputs.model_shapes import write_shape
    from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sloserve-cpu-fp8-"))
    overrides: dict[str, Any] = {"num_hidden_layers": args.layers}
    for item in args.override:
        field, _, value = item.partition("=")
        overrides[field] = int(value)
    folder = write_shape(args.shape, work / "shape", save_small_tokenizer(work / "tokenizer"),
                         **overrides)
    engines = {}
    for label, dtype, quantization in CONFIGS:
        engines[label] = LLM(model=str(folder), load_format="dummy", dtype=dtype,
                             quantization=quantization, device="cpu", kv_cache_memory_gb=0.25,
                             max_model_len=512, startup_calibration=False, slo_preemption=False)
    try:
        memory = {label: _weight_bytes(llm.engine.executor.runner.model)
                  for label, llm in engines.items()}
        for llm in engines.values():  # warm-up: first-touch of buffers, oneDNN primitives
            _decode_round(llm, args.batch, 2, args.prompt_len)
        rates: dict[str, list[float]] = {label: [] for label in engines}
        for _ in range(args.rounds):
            for label, llm in engines.items():
                rates[label].append(_decode_round(llm, args.batch, args.tokens,
                                                  args.prompt_len))
    finally:
        for llm in engines.values():
            llm.shutdown()

    median = {label: statistics.median(r) for label, r in rates.items()}
    result = {"shape": args.shape, "overrides": overrides, "batch": args.batch,
              "tokens": args.tokens, "rounds": args.rounds,
              "torch_threads": torch.get_num_threads(),
              "configs": {label: {"decode_tokens_per_s": median[label],
                                  "rounds_tokens_per_s": rates[label],
                                  "weight_mb": memory[label]["total"] / 1e6,
                                  "linear_weight_mb": memory[label]["linear"] / 1e6}
                          for label in engines},
              "fp8_vs_bf16_decode": median["fp8 (bf16 compute)"] / median["bfloat16"],
              "fp8_vs_float32_decode": median["fp8 (float32 compute)"] / median["float32"]}
    print(f"{args.shape}, {args.layers} layers, batch {args.batch}, {args.tokens} tokens x "
          f"{args.rounds} rounds, {torch.get_num_threads()} torch threads")
    print(f"{'config':24s} {'decode tok/s':>12s} {'weights MB':>11s} {'linear MB':>10s}")
    for label in engines:
        c = result["configs"][label]
        print(f"{label:24s} {c['decode_tokens_per_s']:12.2f} {c['weight_mb']:11.1f} "
              f"{c['linear_weight_mb']:10.1f}")
    print(f"fp8/bf16 decode {result['fp8_vs_bf16_decode']:.2f}x, fp8/float32 decode "
          f"{result['fp8_vs_float32_decode']:.2f}x")
    print(json.dumps(result))
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
