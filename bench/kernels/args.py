"""The kernel benchmark's flags and shape defaults (gpu_kernels.py parses them); torch is
imported only once they are parsed."""

from __future__ import annotations

import argparse

# --dtype: the names, and torch dtypes by name (read after parsing: importing torch is slow).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Shapes: full runs (GPU) and --smoke (CPU interpreter); any shape flag overrides either.
FULL = {"batches": [1, 8, 32, 128], "contexts": [1024, 4096, 16384, 32768],
        "chunks": [512, 2048], "prefixes": [0, 2048, 8192], "num_heads": 32, "num_kv_heads": 8,
        "head_dim": 128, "block_size": 16, "warmup": 5, "repeats": 20, "long_context": 16384,
        "hidden_size": 4096, "intermediate_size": 14336, "fused_tokens": [1, 32, 256, 2048, 16384]}
SMOKE = {"batches": [1, 3], "contexts": [40, 100], "chunks": [8, 24], "prefixes": [0, 40],
         "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, "warmup": 1,
         "repeats": 2, "long_context": 100, "hidden_size": 64, "intermediate_size": 96,
         "fused_tokens": [1, 5]}

# --smoke --sweep-configs: one tiny shape per kind (each of its configs runs on it).
SWEEP_SMOKE_SHAPES = {"batches": [2], "contexts": [100], "chunks": [24], "prefixes": [40]}

SECTIONS = ("decode", "prefill", "norm", "rotary", "silu")


EPILOG = ("Shape defaults: full run " + ", ".join(f"{k}={v}" for k, v in FULL.items())
          + "; --smoke " + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + ".")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (`python -m bench.kernels.gpu_kernels`)."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU under Triton's interpreter (not a "
                             "measurement; keeps the script from rotting untested)")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes")
    parser.add_argument("--contexts", type=int, nargs="+",
                        help="decode context lengths (tokens, including the decoded one)")
    parser.add_argument("--chunks", type=int, nargs="+", help="prefill chunk lengths")
    parser.add_argument("--prefixes", type=int, nargs="+",
                        help="cached prefix lengths under each prefill chunk")
    parser.add_argument("--num-heads", type=int, help="query heads")
    parser.add_argument("--num-kv-heads", type=int, help="KV heads")
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--block-size", type=int, help="KV cache block size (tokens)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--warmup", type=int, help="untimed calls per shape and kernel")
    parser.add_argument("--repeats", type=int, help="timed calls per shape and kernel (median)")
    parser.add_argument("--peak-gbps", type=float,
                        help="device peak memory bandwidth (default: from the device)")
    parser.add_argument("--long-context", type=int,
                        help="decode contexts >= this are held to the bandwidth target")
    parser.add_argument("--target-pct", type=float, default=70.0,
                        help="decode bandwidth target on long contexts, %% of peak")
    parser.add_argument("--hidden-size", type=int, help="RMSNorm width")
    parser.add_argument("--intermediate-size", type=int, help="SiLU-and-mul width (MLP size)")
    parser.add_argument("--fused-tokens", type=int, nargs="+",
                        help="token counts for the RMSNorm, rotary and SiLU-and-mul sections")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="also write every table (title, headers, rows) as JSON here")
    parser.add_argument("--sweep-configs", action="store_true",
                        help="instead of the sections: time the attention kernel's candidate "
                             "launch configs on the decode and prefill shapes (those of "
                             "--sections) against SDPA and print the best")
    parser.add_argument("--sweep-until-s", type=float, default=None, metavar="S",
                        help="with --sweep-configs: start no config after S seconds from the "
                             "script's start, and report what was measured")


def finish_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the shape defaults of the run's kind (full or --smoke) and check the flags."""
    if args.sweep_until_s is not None and not args.sweep_configs:
        parser.error("--sweep-until-s needs --sweep-configs")
    if args.smoke and args.sweep_configs:
        # One tiny shape per kind: the interpreter runs every config on each.
        for key, value in SWEEP_SMOKE_SHAPES.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    import torch

    args.dtype = getattr(torch, DTYPES[args.dtype])
    if args.num_heads % args.num_kv_heads:
        parser.error("--num-heads must be a multiple of --num-kv-heads")
    return args
