"""`sloserve bench ...`: the benchmark suite behind one command, as `vllm bench ...` is.

Each family of benchmarks adds its subcommands here (a module with `add_subcommands(sub)`), so
that a standing benchmark runs the same way from the CLI, from a script in bench/ and from a test.

  trace   write a seeded trace (JSONL) of a built-in workload              (attainment)
  run     replay traces against policies x budgets x rates x seeds          (attainment)
  sweep   find fcfs' 50% attainment rate, run the grid at 0.5x/1x/1.5x      (attainment)
  report  rebuild the Markdown table and plots from a results JSON         (attainment)
  shape   write a model folder of a real shape without its weights, for --load-format dummy
          runs (config.json and a tokenizer that covers the shape's vocabulary)

The standing end-to-end benchmarks (each `--output PATH` writes its figures to a file too):

  throughput  prefill and decode tokens/s vs HF transformers, and the roofline figures;
              with --device DEVICE the device benchmark instead: a real --shape (default
              llama-3.1-8b) with dummy weights against the device's measured limits, CUDA graphs
              against --enforce-eager (engine/benchmarks/device_throughput/)
  latency     an urgent request's arrival -> the stop of a long prefill (--simulate supported)
  serve       the offline engine vs the same requests through `sloserve serve` (HTTP, SSE)
  soak        N concurrent clients for T seconds against a real server; nothing may be lost
  flood       10x a server's queue bound in requests at once (one server or a fleet): only
              429s and completed 200s, urgent ones within their objectives, counters agreeing
  host        the engine loop's host time per step and per sequence against a simulated
              device (--simulate's profile), and the share of its time the device sits idle
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from engine.benchmarks.inputs import model_shapes
from engine.benchmarks.attainment import cli as attainment_cli


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="the benchmark suite: SLO attainment, "
                                                "throughput, latency, serving, soak, "
                                                "shapes",
                                  description=__doc__ + "\n" + (attainment_cli.__doc__ or ""),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", metavar="COMMAND")

    def show_commands(args: argparse.Namespace) -> int:
        # A bare `sloserve bench` asks what the suite offers: show it rather than an error.
        bench.print_help()
        return 0

    bench.set_defaults(func=show_commands)

    attainment_cli.add_subcommands(sub)

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

    # Its own parser (engine/benchmarks/fleet/routing_cost.py: main(argv)) reads the rest.
    routing_cost = sub.add_parser(
        "routing-cost", add_help=False,
        help="per-decision cost of the fleet router's policies (its options: "
             "`sloserve bench routing-cost --help`)")
    routing_cost.set_defaults(func=_run_routing_cost)

    def hand_over(args: Any = None, namespace: Any = None) -> Any:
        # argparse hands a chosen subcommand's arguments to its parser's parse_known_args:
        # every one of them (--help included) goes to the benchmark's own parser.
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.func = _run_routing_cost
        namespace.routing_cost_args = list(args or [])
        return namespace, []

    routing_cost.parse_known_args = hand_over  # type: ignore[method-assign]


def _run_routing_cost(args: argparse.Namespace) -> int:
    module = importlib.import_module("engine.benchmarks.fleet.routing_cost")
    return int(module.main(args.routing_cost_args) or 0)


# (subcommand, module under engine/benchmarks, one-line help)
STANDING_BENCHMARKS = [
    ("throughput", "e2e.throughput", "prefill and decode tokens/s vs HF transformers, roofline; "
                                     "--device: a real shape against the device's limits"),
    ("latency", "e2e.latency", "an urgent arrival -> the stop of a long prefill"),
    ("serve", "e2e.serve_overhead", "the offline engine vs through the HTTP server"),
    ("soak", "e2e.soak", "concurrent clients against a real server for a while"),
    ("flood", "flood.flood", "10x the queue bound at once against one server or a fleet: "
                             "only 429s and completed 200s"),
    ("host", "e2e.host", "the engine loop's host time per step and per sequence against a "
                         "simulated device, and the share of its time the device sits idle"),
    ("structured", "e2e.structured_overhead", "TPOT with structured outputs (a JSON schema) "
                                              "vs unconstrained, one batch beside the other"),
]


# A standing benchmark's second mode, chosen by a flag on its command line: (the flag, the
# mode's module in engine/benchmarks, the flag's help in the first mode's). Its options are its
# own parser's: they overlap the first mode's (--model, --dtype, --output).
SELECTED_BY_FLAG = {
    "throughput": ("--device", "device_throughput.benchmark",
                   "run the device benchmark instead of this one: a real "
                   "--shape (default llama-3.1-8b) with dummy weights against the device's "
                   "measured copy bandwidth and matmul rate, CUDA graphs against "
                   "--enforce-eager, HF beside it (--no-hf: not). Its options: "
                   "`sloserve bench throughput --device cuda --help`"),
}


def _names_flag(args: Any, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args or [])


def _add_loaded_on_use(sub: Any, name: str, module_name: str, summary: str) -> None:
    """A subcommand whose module is imported only when the subcommand is parsed: the standing
    benchmarks import torch, the engine and httpx at the top, and every `sloserve` command
    builds this parser (`sloserve --help` would wait seconds for them). With its
    SELECTED_BY_FLAG flag on the command line, the second mode's module and parser instead."""
    parser = sub.add_parser(name, help=summary,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parse_known_args = parser.parse_known_args
    flag, second_module, flag_help = SELECTED_BY_FLAG.get(name, (None, None, None))
    second: list[argparse.ArgumentParser] = []

    def load_then_parse(args: Any = None, namespace: Any = None) -> Any:
        if flag is not None and _names_flag(args, flag):
            if not second:
                second.append(_loaded_parser(parser.prog, second_module))
            return second[0].parse_known_args(args, namespace)
        if parser.get_default("func") is None:
            _load_into(parser, module_name)
            if flag is not None:
                # Listed in this mode's --help; its value is read above, before this parser.
                parser.add_argument(flag, dest="selects_second_mode",
                                    metavar="{auto,cpu,cuda}",
                                    help=flag_help)
        parsed, rest = parse_known_args(args, namespace)
        if getattr(parsed, "selects_second_mode", None) is not None:
            parser.error(f"spell {flag} out in full (it selects another benchmark)")
        return parsed, rest

    # argparse hands a chosen subcommand's arguments to its parser's parse_known_args.
    parser.parse_known_args = load_then_parse  # type: ignore[method-assign]


def _load_into(parser: argparse.ArgumentParser, module_name: str) -> None:
    module = importlib.import_module(f"engine.benchmarks.{module_name}")
    parser.description = module.__doc__
    module.add_arguments(parser)
    parser.set_defaults(func=module.run)


def _loaded_parser(prog: str, module_name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _load_into(parser, module_name)
    return parser
