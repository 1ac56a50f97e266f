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
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.benchmarks import model_shapes
from engine.benchmarks.attainment import cli as attainment_cli
from engine.benchmarks.kernels import cli as kernels_cli
from engine.benchmarks.suite import cli as suite_cli


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="the benchmark suite: SLO attainment, "
                                                "kernels, the GPU suite, model shapes",
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
