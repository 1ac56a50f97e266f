"""`sloserve bench suite OUT_DIR [--core] [--only STEP]...`: the GPU suite, what a GPU machine
held briefly measures, in two calls sized for 15 minutes of device time.

It runs engine/benchmarks/suite/gpu_suite.sh (the same script as `bash bench/suite/gpu_suite.sh`,
whose header says what each call runs) with these arguments: the same steps (smoke, throughput,
calibrate, burst-http-2048, stream-gaps in the core call; equality, tests-cuda,
preempt-latency, burst-http-unchunked, throughput-hf, kernels, tests-triton-compiled,
burst-inprocess in the full one), each under its own time limit and the call's deadline, and
the same files: OUT_DIR/summary.md (printed at the end), OUT_DIR/suite.json, steps.tsv and each
step's log. Exit status: 0 when every step passed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parent / "gpu_suite.sh"


def script_argv(args: argparse.Namespace) -> list[str]:
    """The gpu_suite.sh command line of parsed `sloserve bench suite` arguments."""
    argv = ["bash", str(SCRIPT), args.out_dir]
    for flag in ("core", "dry_run", "smoke", "assume_capture_failed"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for flag in ("device", "shape", "deadline_s"):
        if getattr(args, flag) is not None:
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    for limit in args.limit or []:
        argv += ["--limit", limit]
    for step in args.only or []:
        argv += ["--only", step]
    return argv


def _cmd_suite(args: argparse.Namespace) -> int:
    argv = script_argv(args)
    bash = shutil.which("bash")
    if bash is None:
        print("sloserve bench suite needs bash (it runs engine/benchmarks/suite/gpu_suite.sh)",
              file=sys.stderr)
        return 2
    # The script's steps run `$PYTHON -m ...`: this interpreter, unless the caller named one.
    env = dict(os.environ)
    env.setdefault("PYTHON", sys.executable)
    sys.stdout.flush()
    sys.stderr.flush()
    # Replaced by bash: its signals (a deadline's TERM) reach the suite's own handler as they
    # would under `bash bench/suite/gpu_suite.sh`.
    os.execve(bash, [bash, *argv[1:]], env)
    return 0  # not reached


def add_subcommands(sub: Any) -> None:
    """`sloserve bench suite` under the `bench` parser's subparsers."""
    suite = sub.add_parser("suite", help="the GPU suite (what a GPU machine measures; --smoke on "
                                         "a CPU)",
                           description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    suite.add_argument("out_dir", metavar="OUT_DIR", help="where the steps' files go")
    suite.add_argument("--core", action="store_true",
                       help="the core call (the decisive figures); default: the full call")
    suite.add_argument("--dry-run", action="store_true",
                       help="on a CPU: both calls' steps with their full-size flags, each "
                            "stopping once its engine configuration is built")
    suite.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None)
    suite.add_argument("--smoke", action="store_true",
                       help="a tiny random Llama and each step's smoke sizes (a CPU run)")
    suite.add_argument("--shape", default=None, help="the model shape (default llama-3.1-8b)")
    suite.add_argument("--deadline-s", type=int, default=None, metavar="S",
                       help="the whole call's deadline (default 330 s; x4 with --smoke)")
    suite.add_argument("--limit", action="append", default=None, metavar="STEP=S",
                       help="replace a step's own time limit (repeatable)")
    suite.add_argument("--only", action="append", default=None, metavar="STEP",
                       help="run only this step of the call (repeatable)")
    suite.add_argument("--assume-capture-failed", action="store_true",
                       help="every engine runs --enforce-eager, as after a failed capture")
    suite.set_defaults(func=_cmd_suite)
