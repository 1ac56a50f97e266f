"""The GPU suite's first step: does the engine start and serve on this GPU, with CUDA graphs?

    python -m bench.suite.gpu_smoke --model DIR --load-format dummy --device cuda --output smoke.json

The suite runs it on its shape cut to 2 layers (every kernel and every graph kind of the full
shape, at a fraction of the start-up time), so that in half a minute it knows whether the rest
of the call can use graphs. It starts an engine as `sloserve serve` would (graphs on), serves a
decode batch and a prefill chunk (the two kinds of captured step: full decode graphs and the
pieces between attention ops), and checks both kinds replayed. If building or serving with
graphs fails, it tries once more with --enforce-eager.

Exit status, which the suite reads: 0 the engine served (with graphs where the device has them),
3 graphs failed and --enforce-eager served (every later step must run eager), 1 neither.
Each phase is appended to ``OUT``'s ``.jsonl`` twin as it ends (a killed run keeps them); the
whole report goes to ``--output`` at exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from engine.benchmarks.measure.figures import FigureLog, jsonl_twin

EXIT_GRAPHS_FAILED = 3


def _runner(llm: Any) -> Any:
    return getattr(getattr(llm.engine, "executor", None), "runner", None)


def _graph_replays(runner: Any) -> dict[str, int | None]:
    """Replays so far of each kind of captured step (None: that kind was not captured)."""
    decode = getattr(runner, "graphs", None)
    pieces = getattr(runner, "piecewise", None)
    return {"decode": None if decode is None else decode.replays,
            "pieces": None if pieces is None else pieces.replays}


def _startup(runner: Any) -> dict[str, Any] | None:
    report = getattr(runner, "startup_report", None)
    if report is None:
        return None
    return dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(vars(report))


def try_engine(args: argparse.Namespace, enforce_eager: bool,
               lines: FigureLog) -> dict[str, Any]:
    """Start an engine, serve a decode batch and a prefill chunk; the phase's figures (with
    ``error`` set where it failed)."""
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    phase: dict[str, Any] = {"enforce_eager": enforce_eager, "error": None}
    started = time.perf_counter()
    llm = None
    try:
        from engine.runtime.model_setup import load_hf_config

        longest = getattr(load_hf_config(args.model), "max_position_embeddings", None)
        max_model_len = min(args.max_model_len, longest or args.max_model_len)
        llm = LLM(model=args.model, load_format=args.load_format, device=args.device,
                  dtype=args.dtype, enforce_eager=enforce_eager, max_model_len=max_model_len,
                  max_num_batched_tokens=args.chunk_tokens, enable_prefix_caching=False,
                  startup_calibration=False)
        phase["start_s"] = time.perf_counter() - started
        runner = _runner(llm)
        phase["device"] = str(getattr(runner, "device", llm.engine.config.model.device))
        phase["startup"] = _startup(runner)
        lines.write("engine_started", **phase)
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        vocab = llm.engine.model.hf_config.vocab_size
        # A decode batch (short prompts, many steps of decodes only) ...
        prompts = [{"prompt_token_ids": [(7 * i + j) % vocab for j in range(8)]}
                   for i in range(args.decode_batch)]
        served = time.perf_counter()
        outputs = llm.generate(prompts, params)
        # ... and one prompt of a whole chunk (a step carrying prefill tokens).
        long = [{"prompt_token_ids": [(13 * j + 5) % vocab for j in range(args.chunk_tokens)]}]
        outputs += llm.generate(long, SamplingParams(max_tokens=2, temperature=0.0,
                                                     ignore_eos=True))
        phase["serve_s"] = time.perf_counter() - served
        phase["tokens"] = sum(len(o.outputs[0].token_ids) for o in outputs)
        phase["replays"] = _graph_replays(runner)
    except Exception as exc:  # reported, and the caller decides what to try next
        phase["error"] = f"{type(exc).__name__}: {exc}"
        phase["traceback"] = traceback.format_exc()
        print(phase["traceback"], file=sys.stderr)
    finally:
        if llm is not None:
            llm.shutdown()
            del llm
    lines.write("engine", **phase)
    return phase


def graphs_ran(phase: dict[str, Any]) -> bool:
    """Whether both kinds of captured step were captured and replayed."""
    replays = phase.get("replays") or {}
    return bool(replays) and all(replays.values())


def expects_graphs(phase: dict[str, Any]) -> bool:
    """On CUDA an engine captures graphs unless told not to; elsewhere only the test stand-in
    does (workers.graphs.cuda_graphs.FAKE_GRAPHS_ENV), and then it must replay them too."""
    replays = phase.get("replays") or {}
    return (phase.get("device", "").startswith("cuda")
            or any(count is not None for count in replays.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder (`sloserve bench shape`)")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="at most the model's own (a short one: the smoke serves 512 tokens)")
    parser.add_argument("--chunk-tokens", type=int, default=512,
                        help="the prefill prompt and the step budget (512: the largest step "
                             "CUDA graph pieces hold by default)")
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="the JSON report (and PATH's .jsonl twin, line by line)")
    args = parser.parse_args(argv)
    out = Path(args.output) if args.output else None
    lines = FigureLog(jsonl_twin(out) if out else None)

    phases = [try_engine(args, enforce_eager=False, lines=lines)]
    first = phases[0]
    graphs_failed = first["error"] is not None or (expects_graphs(first)
                                                   and not graphs_ran(first))
    if graphs_failed:
        print("smoke: the engine failed with CUDA graphs on; trying --enforce-eager",
              file=sys.stderr)
        phases.append(try_engine(args, enforce_eager=True, lines=lines))
    served = phases[-1]["error"] is None
    if graphs_failed:
        verdict = "eager" if served else "failed"
    else:
        verdict = "graphs" if expects_graphs(first) else "no graphs on this device"
    report = {"verdict": verdict, "phases": phases}
    lines.write("verdict", verdict=verdict)
    if out is not None:
        out.write_text(json.dumps(report, indent=2))
    print(f"smoke: {verdict}; start {first.get('start_s', float('nan')):.1f} s, "
          f"replays {first.get('replays')}, error {first['error']}")
    if not served:
        return 1
    return EXIT_GRAPHS_FAILED if graphs_failed else 0


if __name__ == "__main__":
    sys.exit(main())
