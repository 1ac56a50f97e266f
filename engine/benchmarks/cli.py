"""`sloserve bench ...`: the benchmark suite behind one command, as `vllm bench ...` is.

Each family of benchmarks adds its subcommands here (a module with `add_subcommands(sub)`), so
that a standing benchmark runs the same way from the CLI, from a script in bench/ and from a test.

  trace   write a seeded trace (JSONL) of a built-in workload              (attainment)
  run     replay traces against policies x budgets x rates x seeds          (attainment)
  sweep   find fcfs' 50% attainment rate, run the grid at 0.5x/1x/1.5x      (attainment)
  report  rebuild the Markdown table and plots from a results JSON         (attainment)
  kernels Triton attention and fused kernels against PyTorch's, decode bandwidth against the
          device's peak (a GPU; --smoke: tiny shapes on the CPU in Triton's interpreter)
  suite   the GPU suite: OUT_DIR [--core] [--only STEP]; steps under per-step time limits,
          OUT_DIR/summary.md and suite.json (engine/benchmarks/suite/gpu_suite.sh)
  shape   write a model folder of a real shape without its weights, for --load-format dummy
          runs (config.json and a tokenizer that covers the shape's vocabulary)

The standing end-to-end benchmarks (each `--output PATH` writes its figures to a file too):

  throughput  prefill and decode tokens/s vs HF transformers, and the roofline figures
  latency     an urgent request's arrival -> the stop of a long prefill (--simulate supported)
  serve       the offline engine vs the same requests through `sloserve serve` (HTTP, SSE)
  soak        N concurrent clients for T seconds against a real server; nothing may be lost
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from engine.benchmarks import model_shapes
from engine.benchmarks.attainment import cli as attainment_cli
from engine.benchmarks.kernels import cli as kernels_cli
from engine.benchmarks.suite import cli as suite_cli


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="the benchmark suite: SLO attainment, "
                                                "throughput, latency, serving, soak, "
                                                "kernels, the GPU suite, shapes",
                                  description=__doc__ + "\n" + (attainment_cli.__doc__ or ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", metavar="COMMAND")

    def show_commands(args: argparse.Namespace) -> int:
        # A bare `sloserve bench` asks what the suite offers: show it rather than an error.
        bench.print_help()
        return 0

    bench.set_defaults(func=show_commands)

    attainment_cli.add_subcommands(sub)
    kernels_cli.add_subcommands(sub)
    suite_cli.add_subcommands(sub)

    shape = sub.add_parser("shape", help="write a model folder of a real shape without weights "
                                         "(config.json and a tokenizer), for --load-format dummy",
                           description=model_shapes.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    model_shapes.add_arguments(shape)
    shape.set_defaults(func=model_shapes.run)

    # The standing end-to-end benchmarks: each module's own arguments and run, which its
    # script in bench/e2e/ calls too.
    for name, module, summary in STANDING_BENCHMARKS:
        _add_loaded_on_use(sub, name, module, summary)


# (subcommand, module in engine/benchmarks, one-line help)
STANDING_BENCHMARKS = [
    ("throughput", "throughput", "prefill and decode tokens/s vs HF transformers, roofline"),
    ("latency", "latency", "an urgent arrival -> the stop of a long prefill"),
    ("serve", "serve_overhead", "the offline engine vs through the HTTP server"),
    ("soak", "soak", "concurrent clients against a real server for a while"),
]


def _add_loaded_on_use(sub: Any, name: str, module_name: str, summary: str) -> None:
    """A subcommand whose module is imported only when the subcommand is parsed: the standing
    benchmarks import torch, the engine and httpx at the top, and every `sloserve` command
    builds this parser (`sloserve --help` would wait seconds for them)."""
    parser = sub.add_parser(name, help=summary,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parse_known_args = parser.parse_known_args

    def load_then_parse(args: Any = None, namespace: Any = None) -> Any:
        if parser.get_default("func") is None:
            module = importlib.import_module(f"engine.benchmarks.{module_name}")
            parser.description = module.__doc__
            module.add_arguments(parser)
            parser.set_defaults(func=module.run)
        return parse_known_args(args, namespace)

    # argparse hands a chosen subcommand's arguments to its parser's parse_known_args.
    parser.parse_known_args = load_then_parse  # type: ignore[method-assign]
