"""`sloserve bench kernels`: the GPU kernel benchmark (engine/benchmarks/kernels/gpu_kernels.py).

The same flags as `python -m bench.kernels.gpu_kernels`: without CUDA it prints one line and
exits 0; `--smoke` runs tiny shapes on the CPU under Triton's interpreter; `--sweep-configs`
times the attention's candidate launch configs; `--output PATH` writes every table as JSON.
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def _cmd_kernels(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    from engine.benchmarks.kernels import gpu_kernels

    return gpu_kernels.run(gpu_kernels.finish_args(args.parser, args), started)


def add_subcommands(sub: Any) -> None:
    """`sloserve bench kernels` under the `bench` parser's subparsers."""
    # The flags only (no torch): the run imports the benchmark, and no Triton kernel module is
    # imported before it decides on TRITON_INTERPRET.
    from engine.benchmarks.kernels import args as kernel_args

    kernels = sub.add_parser("kernels", help="Triton attention and fused kernels against "
                                             "PyTorch's (GPU; --smoke on the CPU)",
                             description=__doc__, epilog=kernel_args.EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    kernel_args.add_arguments(kernels)
    kernels.set_defaults(func=_cmd_kernels, parser=kernels)
