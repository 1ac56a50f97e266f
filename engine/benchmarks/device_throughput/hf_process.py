"""The HF transformers side of benchmark.py, run in a process of its own.

    python -m engine.benchmarks.device_throughput.hf_process SPEC.json OUT.json

benchmark.py starts this as a subprocess so that HF's weights, KV cache and CUDA
state never share a process (or a caching allocator) with the engine's. SPEC names the model
folder (its config.json alone: the weights are HF's own random init, drawn on the device, as
the engine's `--load-format dummy` draws its), the device and dtype, and the sizes; OUT gets
the figures as JSON. What is timed is what a plain HF script runs:

- prefill: ``model(input_ids)`` over one prompt of ``prefill_len`` tokens, only the last row's
  logits computed (``logits_to_keep=1``, as a server samples one token);
- decode: the whole batch's prompts prefilled in one forward (untimed), then one forward per
  step over the batch's last tokens with the model's own KV cache, the next token greedy
  (argmax); one untimed warm-up step, then the median of the timed steps.

Prompts are the same seeded random ids the engine gets (engine.benchmarks.inputs.random_prompts).
"""

from __future__ import annotations

import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.benchmarks.inputs.random_prompts import random_prompts


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_keyword(model: Any) -> str:
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name is
    deprecated until 5.40); a GPU image may carry either side of the rename."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(output: Any) -> Any:
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def build_model(model_dir: str, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """The folder's architecture with random weights, made directly on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.benchmarks.reference.hf_reference import fastest_attention

    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation=fastest_attention(config))
    return model.eval()


def bench_prefill(model: Any, device: torch.device, vocab: int, prompt_len: int, prompts: int,
                  seed: int) -> dict[str, float | int]:
    ids = [torch.tensor([p], device=device)
           for p in random_prompts(vocab, prompts + 1, prompt_len, seed)]
    model(input_ids=ids[0], use_cache=False, logits_to_keep=1)  # warm-up: cuBLAS plans, caches
    times = []
    for prompt in ids[1:]:
        _synchronize(device)
        started = time.perf_counter()
        model(input_ids=prompt, use_cache=False, logits_to_keep=1)
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return {"prompt_len": prompt_len, "prompts": prompts,
            "tokens_per_s": prompt_len * prompts / sum(times),
            "step_ms": 1000 * statistics.median(times)}


def bench_decode(model: Any, device: torch.device, vocab: int, batch: int, context: int,
                 steps: int, seed: int) -> dict[str, float | int]:
    keyword = _cache_keyword(model)
    ids = torch.tensor(random_prompts(vocab, batch, context, seed), device=device)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    cache = _cache_of(out)
    times = []
    for _ in range(steps + 1):  # the first step is an untimed warm-up
        _synchronize(device)
        started = time.perf_counter()
        out = model(input_ids=token, use_cache=True, **{keyword: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        cache = _cache_of(out)
        _synchronize(device)
        times.append(time.perf_counter() - started)
    step_s = statistics.median(times[1:])
    # Step j (0 = the warm-up) feeds position context + j, which attends to context + j + 1
    # keys; the timed steps are j = 1..steps.
    mean_context = context + 1 + (1 + steps) / 2
    del out, cache, token, ids
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "mean_context": mean_context,
            "steps_measured": steps, "tokens_per_s": batch / step_s,
            "tpot_ms": 1000 * step_s, "step_ms_max": 1000 * max(times[1:])}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import transformers

    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    started = time.perf_counter()
    model = build_model(spec["model"], device, dtype, spec["seed"])
    build_s = time.perf_counter() - started
    vocab = model.config.vocab_size
    result: dict[str, Any] = {"transformers": transformers.__version__,
                              "attn_implementation": model.config._attn_implementation,
                              "build_s": build_s}
    with torch.inference_mode():
        result["prefill"] = bench_prefill(model, device, vocab, spec["prefill_len"],
                                          spec["prefill_prompts"], spec["seed"])
        print(f"hf prefill {spec['prefill_len']}: "
              f"{result['prefill']['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
        result["decode"] = {}
        for batch in spec["batches"]:
            row = bench_decode(model, device, vocab, batch, spec["context"],
                               spec["decode_steps"], spec["seed"] + batch)
            result["decode"][str(batch)] = row
            print(f"hf decode {batch} x {spec['context']}: {row['tokens_per_s']:.1f} tok/s, "
                  f"TPOT {row['tpot_ms']:.2f} ms", file=sys.stderr, flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m engine.benchmarks.device_throughput.hf_process SPEC.json OUT.json",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(run(spec), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
