"""GPU kernel benchmark: the Triton paged-attention kernel (and the fused RMSNorm / rotary /
SiLU-and-mul kernels, when they exist) against what PyTorch would run instead, on one CUDA device.

Decode (one query token per sequence over its whole cached context) is memory-bound: a step
reads every cached K and V vector of every sequence once and does two dot products per vector.
Its figure of merit is therefore the achieved HBM bandwidth, bytes of K and V read (context
tokens x KV heads x head_dim x 2 tensors x dtype size, plus the query and output) per second,
and its fraction of the device's peak; the target is >= 70% of peak on long contexts. The
baseline is PyTorch SDPA (enable_gqa=True) over K/V already gathered into contiguous
[B, Hkv, ctx, D] tensors: the same attention with an ideal memory layout, so a speedup below 1
is the cost of reading through block tables. The gather is done once, untimed: counting it would
make the baseline strawman-slow. A second decode table times the shorter contexts under the
split plan of the longest (as a CUDA graph captured for max_model_len replays them) next to the
eager launch's own plan. Prefill chunks (many query tokens over a cached prefix) are
compute-bound, so they report TFLOP/s instead; SDPA gets a lower-right causal mask over the
gathered prefix + chunk.

Inputs are built as the engine builds them (workers/model_runner.py prepare_inputs): a paged
cache [num_blocks, block_size, Hkv, D] filled with random values, block tables of shuffled block
ids, the slot mapping of this step's tokens, and an AttentionMetadata with decodes first, then
prefill chunks. Each shape is timed with CUDA events after warm-up calls, median of --repeats;
the L2 cache is flushed (a 256 MiB write) before every repetition, since small shapes fit in
L2 and repeated calls would otherwise overstate HBM bandwidth. Each row also prints the largest
difference between the two outputs: a fast wrong kernel is not a result.

`--sweep-configs` times the attention kernel's candidate launch configs (tiles, warps, pipeline
stages) on the decode and prefill shapes instead, and prints the one a default should be
(attention_sweep.py).

Without CUDA it prints one line and exits 0. `--smoke` runs tiny shapes on the CPU under
Triton's interpreter (timed with perf_counter) so that every code path of this script is
exercised where there is no GPU; its figures are not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.kernels.args import (DTYPES, EPILOG, FULL, SECTIONS,  # noqa: F401
                                SMOKE, SWEEP_SMOKE_SHAPES, add_arguments, finish_args)
from bench.kernels.harness import (TABLES, TOLERANCE, Timer, build_batch, fits, gathered,
                                   kv_bytes_per_token, max_diff, peak_bandwidth, print_table,
                                   release)
from bench.suite.dry_run import stop_if_dry_run_without_engine

NEEDS_GPU = ("bench.kernels.gpu_kernels needs an NVIDIA GPU (CUDA is not available here); kernel "
             "correctness is covered by tests/kernels/test_triton_kernels.py in Triton's "
             "interpreter, and `python -m bench.kernels.gpu_kernels --smoke` exercises this "
             "benchmark on the CPU.")
SMOKE_BANNER = ("SMOKE RUN: tiny shapes on the CPU under Triton's interpreter, timed with "
                "perf_counter. The figures below are NOT measurements; they only show that the "
                "script's code paths run.")


# ---------------------------------------------------------------------------------------------
# Report helpers


def diff_cell(diff: float, dtype: torch.dtype, bad: list[str], label: str) -> str:
    if not math.isfinite(diff) or diff > TOLERANCE[dtype]:
        bad.append(f"{label}: max|diff| {diff:.3g} > {TOLERANCE[dtype]:g}")
        return f"{diff:.2e} !"
    return f"{diff:.2e}"


def report_mismatches(bad: list[str]) -> None:
    for line in bad:
        print(f"WARNING: outputs differ beyond tolerance at {line}")


# ---------------------------------------------------------------------------------------------
# Sections


def bench_decode(args: argparse.Namespace, attention: Any, timer: Timer, device: torch.device,
                 peak: float) -> None:
    dtype, hq, hkv, d = args.dtype, args.num_heads, args.num_kv_heads, args.head_dim
    esize = torch.empty((), dtype=dtype).element_size()
    scale = 1 / math.sqrt(d)
    headers = ["batch", "context", "triton_ms", "sdpa_ms", "speedup", "GB/s", "%peak",
               "max|diff|", "target"]
    rows: list[list[str]] = []
    bad: list[str] = []
    verdicts: list[bool] = []
    for batch_size in args.batches:
        for ctx in args.contexts:
            kv = batch_size * ctx * kv_bytes_per_token(hkv, d, dtype)
            # Paged cache (K and V), the gathered copies for SDPA, one row's gather temporary,
            # query and outputs.
            skip = fits(device, 2 * kv + kv // batch_size + 4 * batch_size * hq * d * esize
                        + (16 << 20))
            if skip:
                rows.append([str(batch_size), str(ctx), skip])
                continue
            batch = build_batch([ctx] * batch_size, [], hq, hkv, d, args.block_size, dtype,
                                device, args.seed)
            triton_call = partial(attention, batch.query, batch.key, batch.value,
                                  batch.key_cache, batch.value_cache, batch.meta, scale)

            triton_ms = timer(triton_call)
            got = triton_call()
            k, v = gathered(batch, 0, batch_size, ctx)
            q = batch.query.unsqueeze(2)  # [B, Hq, 1, D]
            sdpa_call = partial(F.scaled_dot_product_attention, q, k, v, scale=scale,
                                enable_gqa=True)

            sdpa_ms = timer(sdpa_call)
            diff = max_diff(got, sdpa_call().squeeze(2))
            moved = kv + 2 * batch_size * hq * d * esize  # K/V read + query read + out written
            gbps = moved / (triton_ms / 1000) / 1e9
            pct = 100 * gbps / peak
            target = "-"
            if ctx >= args.long_context:
                verdicts.append(pct >= args.target_pct)
                target = "met" if verdicts[-1] else "MISSED"
            rows.append([str(batch_size), str(ctx), f"{triton_ms:.3f}", f"{sdpa_ms:.3f}",
                         f"{sdpa_ms / triton_ms:.2f}x", f"{gbps:.0f}", f"{pct:.1f}",
                         diff_cell(diff, dtype, bad, f"decode batch {batch_size} ctx {ctx}"),
                         target])
            del batch, got, k, v, q, triton_call, sdpa_call
            release(device)
    print_table(f"decode: {hq} q heads / {hkv} KV heads, head_dim {d}, block {args.block_size}, "
                f"{str(dtype).removeprefix('torch.')}; GB/s and %peak are Triton's (bytes of "
                f"K/V read + query/output); speedup = sdpa_ms / triton_ms",
                headers, rows)
    print("SDPA time excludes gathering the paged K/V into contiguous [B, Hkv, ctx, D] tensors "
          "(done once, untimed); Triton reads the paged cache through the block tables.")
    met = sum(verdicts)
    print(f"target: decode at context >= {args.long_context} reaches >= {args.target_pct:g}% of "
          f"peak -> " + (f"met in {met}/{len(verdicts)} rows" + ("" if met == len(verdicts)
                                                                 else " (MISSED in the others)")
                         if verdicts else "no long-context row was run"))
    report_mismatches(bad)


def bench_graph_plan_decode(args: argparse.Namespace, triton_attention: Any, timer: Timer,
                            device: torch.device) -> None:
    """Decodes at the shorter contexts under the split plan of the longest one, as a CUDA graph
    captured for max_model_len replays them (the split count and table width are frozen at
    capture), against the eager launch's own plan and SDPA."""
    dtype, hq, hkv, d, bs = args.dtype, args.num_heads, args.num_kv_heads, args.head_dim, \
        args.block_size
    planned = max(args.contexts)
    scale = 1 / math.sqrt(d)
    headers = ["batch", "context", "splits", "graph_ms", "eager_ms", "sdpa_ms", "speedup",
               "max|diff|"]
    rows: list[list[str]] = []
    bad: list[str] = []
    for batch_size in args.batches:
        # The interpreter's target is one program (no split); split anyway so --smoke runs it.
        splits = max(triton_attention.decode_splits(
            batch_size, hkv, -(-planned // bs) * bs, triton_attention.target_programs(device)),
            1 if device.type == "cuda" else 2)
        for ctx in [c for c in args.contexts if c < planned]:
            kv = batch_size * ctx * kv_bytes_per_token(hkv, d, dtype)
            skip = fits(device, 2 * kv + kv // batch_size + (16 << 20))
            if skip:
                rows.append([str(batch_size), str(ctx), str(splits), skip])
                continue
            batch = build_batch([ctx] * batch_size, [], hq, hkv, d, bs, dtype, device, args.seed)
            tables = torch.zeros((batch_size, -(-planned // bs)), dtype=torch.long, device=device)
            tables[:, :batch.meta.decode_block_tables.shape[1]] = batch.meta.decode_block_tables
            meta = dataclasses.replace(batch.meta, decode_block_tables=tables,
                                       decode_max_context=planned)
            tensors = (batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache)
            graph_call = partial(triton_attention.paged_attention, *tensors, meta, scale,
                                 num_kv_splits=splits)
            eager_call = partial(triton_attention.paged_attention, *tensors, batch.meta, scale)
            k, v = gathered(batch, 0, batch_size, ctx)
            sdpa_call = partial(F.scaled_dot_product_attention, batch.query.unsqueeze(2), k, v,
                                scale=scale, enable_gqa=True)
            graph_ms, eager_ms, sdpa_ms = timer(graph_call), timer(eager_call), timer(sdpa_call)
            diff = max_diff(graph_call(), sdpa_call().squeeze(2))
            rows.append([str(batch_size), str(ctx), str(splits), f"{graph_ms:.3f}",
                         f"{eager_ms:.3f}", f"{sdpa_ms:.3f}", f"{sdpa_ms / graph_ms:.2f}x",
                         diff_cell(diff, dtype, bad, f"graph-plan decode batch {batch_size} "
                                                     f"ctx {ctx}")])
            del batch, meta, k, v, graph_call, eager_call, sdpa_call
            release(device)
    print_table(f"graph-plan decode: contexts under the split plan of context {planned} "
                f"(a CUDA graph captured for it); graph_ms uses that plan, eager_ms the launch's "
                f"own; speedup = sdpa_ms / graph_ms", headers, rows)
    report_mismatches(bad)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                 scale: float) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA over one chunk: q [1, Hq, n, D], k/v [1, Hkv, prefix + n, D]. Returns the call and
    how it masks: is_causal when there is no prefix, else a lower-right causal bias (which
    SDPA can hand to its flash kernel). If that rejects grouped K/V, the K/V are repeated to the
    query heads beforehand (untimed) and the row says so."""
    from torch.nn.attention.bias import causal_lower_right

    if prefix == 0:
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                       enable_gqa=True)), "causal"
    bias = causal_lower_right(q.shape[2], k.shape[2])

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale,
                                              enable_gqa=True)

    try:
        call()
        return call, "lower-right"
    except (RuntimeError, NotImplementedError, ValueError):
        group = q.shape[1] // k.shape[1]
        k_full, v_full = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=bias,
                                                       scale=scale)), "lower-right, K/V repeated"


def bench_prefill(args: argparse.Namespace, attention: Any, timer: Timer,
                  device: torch.device) -> None:
    dtype, hq, hkv, d = args.dtype, args.num_heads, args.num_kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    headers = ["chunk", "prefix", "triton_ms", "sdpa_ms", "speedup", "TFLOP/s", "max|diff|",
               "sdpa_mask"]
    rows: list[list[str]] = []
    bad: list[str] = []
    for chunk in args.chunks:
        for prefix in args.prefixes:
            ctx = chunk + prefix
            kv = ctx * kv_bytes_per_token(hkv, d, dtype)
            if skip := fits(device, 4 * kv + (64 << 20)):
                rows.append([str(chunk), str(prefix), skip])
                continue
            batch = build_batch([], [(chunk, prefix)], hq, hkv, d, args.block_size, dtype,
                                device, args.seed)
            triton_call = partial(attention, batch.query, batch.key, batch.value,
                                  batch.key_cache, batch.value_cache, batch.meta, scale)

            triton_ms = timer(triton_call)
            got = triton_call()
            k, v = gathered(batch, 0, 1, ctx)
            q = batch.query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, chunk, D]
            sdpa_call, mask = sdpa_prefill(q, k, v, prefix, scale)
            sdpa_ms = timer(sdpa_call)
            diff = max_diff(got, sdpa_call().squeeze(0).transpose(0, 1))
            # Query i of the chunk sees prefix + i + 1 keys; 2 matmuls x 2 FLOPs per MAC.
            pairs = chunk * prefix + chunk * (chunk + 1) // 2
            tflops = 4 * hq * d * pairs / (triton_ms / 1000) / 1e12
            rows.append([str(chunk), str(prefix), f"{triton_ms:.3f}", f"{sdpa_ms:.3f}",
                         f"{sdpa_ms / triton_ms:.2f}x", f"{tflops:.1f}",
                         diff_cell(diff, dtype, bad, f"prefill chunk {chunk} prefix {prefix}"),
                         mask])
            del batch, got, k, v, q, triton_call, sdpa_call
            release(device)
    print_table(f"prefill: one chunk over a cached prefix, {hq} q heads / {hkv} KV heads, "
                f"head_dim {d}, block {args.block_size}; compute-bound, so TFLOP/s (Triton's, "
                f"causal FLOPs only) instead of GB/s", headers, rows)
    print("SDPA time excludes gathering prefix + chunk K/V into contiguous [1, Hkv, ctx, D] "
          "tensors (done once, untimed).")
    report_mismatches(bad)


def bench_rms_norm(args: argparse.Namespace, triton_norm: Any, timer: Timer,
                   device: torch.device, peak: float) -> None:
    from workers.layers.norm import RMSNorm

    dtype, hidden, eps = args.dtype, args.hidden_size, 1e-5
    esize = torch.empty((), dtype=dtype).element_size()
    norm = RMSNorm(hidden, eps, dtype=dtype, device=device)
    norm.weight.data.normal_(1.0, 0.1)
    norm.fused = None  # the eager PyTorch arithmetic, never a fused kernel a model would install
    weight = norm.weight.data
    headers = ["tokens", "residual", "triton_ms", "torch_ms", "speedup", "GB/s", "%peak",
               "max|diff|"]
    rows: list[list[str]] = []
    bad: list[str] = []
    for tokens in args.fused_tokens:
        for with_residual in (False, True):
            x = torch.empty((tokens, hidden), dtype=dtype, device=device).normal_()
            residual = (torch.empty_like(x).normal_() if with_residual else None)
            # Clones per call: an implementation may update the residual in place.
            expected = norm(x.clone(), None if residual is None else residual.clone())
            got = triton_norm.rms_norm(x.clone(), weight, eps,
                                       residual=None if residual is None else residual.clone())
            if with_residual:
                diff = max(max_diff(got[0], expected[0]), max_diff(got[1], expected[1]))
            else:
                diff = max_diff(got, expected)
            triton_ms = timer(lambda: triton_norm.rms_norm(x, weight, eps, residual=residual))
            torch_ms = timer(lambda: norm(x, residual))
            # Reads x (+ residual) and the weight, writes the output (+ the new residual).
            moved = (4 if with_residual else 2) * tokens * hidden * esize + hidden * esize
            gbps = moved / (triton_ms / 1000) / 1e9
            rows.append([str(tokens), "yes" if with_residual else "no", f"{triton_ms:.4f}",
                         f"{torch_ms:.4f}", f"{torch_ms / triton_ms:.2f}x", f"{gbps:.0f}",
                         f"{100 * gbps / peak:.1f}",
                         diff_cell(diff, dtype, bad, f"rms_norm tokens {tokens}")])
    print_table(f"rms_norm: hidden {hidden}, {str(dtype).removeprefix('torch.')}; triton "
                f"kernels.triton_norm.rms_norm vs workers.layers.norm.RMSNorm (eager PyTorch)",
                headers, rows)
    report_mismatches(bad)


def bench_rotary(args: argparse.Namespace, triton_rotary: Any, timer: Timer,
                 device: torch.device, peak: float) -> None:
    from workers.layers.rotary import apply_rotary

    dtype, heads, d = args.dtype, args.num_heads, args.head_dim
    esize = torch.empty((), dtype=dtype).element_size()
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    headers = ["tokens", "heads", "triton_ms", "torch_ms", "speedup", "GB/s", "%peak",
               "max|diff|"]
    rows: list[list[str]] = []
    bad: list[str] = []
    for tokens in args.fused_tokens:
        positions = torch.randint(0, 32768, (tokens,)).float()
        angles = (positions[:, None] * inv_freq[None, :]).unsqueeze(1)  # [T, 1, D/2]
        cos, sin = angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)
        x = torch.empty((tokens, heads, d), dtype=dtype, device=device).normal_()
        diff = max_diff(triton_rotary.apply_rotary(x.clone(), cos, sin),
                        apply_rotary(x.clone(), cos, sin))
        triton_ms = timer(lambda: triton_rotary.apply_rotary(x, cos, sin))
        torch_ms = timer(lambda: apply_rotary(x, cos, sin))
        moved = 2 * tokens * heads * d * esize + 2 * tokens * (d // 2) * esize
        gbps = moved / (triton_ms / 1000) / 1e9
        rows.append([str(tokens), str(heads), f"{triton_ms:.4f}", f"{torch_ms:.4f}",
                     f"{torch_ms / triton_ms:.2f}x", f"{gbps:.0f}", f"{100 * gbps / peak:.1f}",
                     diff_cell(diff, dtype, bad, f"rotary tokens {tokens}")])
    print_table(f"rotary: x [T, {heads}, {d}], {str(dtype).removeprefix('torch.')}; triton "
                f"kernels.triton_rotary.apply_rotary vs workers.layers.rotary.apply_rotary",
                headers, rows)
    report_mismatches(bad)


def bench_silu_and_mul(args: argparse.Namespace, triton_activation: Any, timer: Timer,
                       device: torch.device, peak: float) -> None:
    from workers.layers.activation import silu_and_mul

    dtype, width = args.dtype, args.intermediate_size
    esize = torch.empty((), dtype=dtype).element_size()
    headers = ["tokens", "width", "triton_ms", "torch_ms", "speedup", "GB/s", "%peak",
               "max|diff|"]
    rows: list[list[str]] = []
    bad: list[str] = []
    for tokens in args.fused_tokens:
        # The gate_up projection's output: [T, 2 * intermediate], gate first.
        x = torch.empty((tokens, 2 * width), dtype=dtype, device=device).normal_(0.0, 2.0)
        diff = max_diff(triton_activation.silu_and_mul(x), silu_and_mul(x))
        triton_ms = timer(lambda: triton_activation.silu_and_mul(x))
        torch_ms = timer(lambda: silu_and_mul(x))
        # Reads gate and up, writes the product.
        moved = 3 * tokens * width * esize
        gbps = moved / (triton_ms / 1000) / 1e9
        rows.append([str(tokens), str(width), f"{triton_ms:.4f}", f"{torch_ms:.4f}",
                     f"{torch_ms / triton_ms:.2f}x", f"{gbps:.0f}", f"{100 * gbps / peak:.1f}",
                     diff_cell(diff, dtype, bad, f"silu_and_mul tokens {tokens}")])
    print_table(f"silu_and_mul: x [T, 2 x {width}], {str(dtype).removeprefix('torch.')}; triton "
                f"kernels.triton_activation.silu_and_mul vs workers.layers.activation."
                f"silu_and_mul (eager F.silu(gate) * up)", headers, rows)
    report_mismatches(bad)


# ---------------------------------------------------------------------------------------------


def optional_module(name: str) -> Any:
    """The module, or None (with a printed note) if its file does not exist yet. A module that
    exists but fails to import is an error, not a skip."""
    if importlib.util.find_spec(name) is None:
        print(f"\n[{name} not found: its section is skipped]")
        return None
    return importlib.import_module(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernels.gpu_kernels", description=__doc__.split("\n\n")[0],
        epilog=EPILOG)
    add_arguments(parser)
    return finish_args(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    return run(parse_args(argv), started)


def run(args: argparse.Namespace, started: float | None = None) -> int:
    """The benchmark on parsed and finished arguments (`finish_args`)."""
    started = time.perf_counter() if started is None else started
    stop_if_dry_run_without_engine(
        f"the {'attention launch-config sweep' if args.sweep_configs else 'kernels'} at "
        f"{'smoke' if args.smoke else 'full'} sizes, {args.repeats} repeats")
    if args.smoke:
        # Before any Triton kernel module is imported: @triton.jit reads it when decorating.
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
        print(SMOKE_BANNER)
    elif not torch.cuda.is_available():
        print(NEEDS_GPU)
        return 0
    else:
        device = torch.device("cuda", torch.cuda.current_device())

    import triton

    timer = Timer(device, args.warmup, args.repeats)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"device: {props.name}, {props.multi_processor_count} SMs, "
              f"{props.total_memory / 2**30:.0f} GiB; CUDA {torch.version.cuda}")
    else:
        print(f"device: cpu ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads), Triton interpreter")
    print(f"torch {torch.__version__}, triton {triton.__version__}, dtype "
          f"{str(args.dtype).removeprefix('torch.')}")
    print(f"timing: median of {args.repeats} calls after {args.warmup} warm-up calls, "
          + ("CUDA events, L2 flushed before each call" if device.type == "cuda"
             else "perf_counter"))
    peak, source = peak_bandwidth(device, args.peak_gbps, timer)
    print(f"peak bandwidth: {peak:.0f} GB/s ({source})")

    sweep = None
    if args.sweep_configs:
        # Imported here: it decorates the kernels, which must follow TRITON_INTERPRET above.
        from bench.kernels import attention_sweep

        sweep = attention_sweep.run_sweep(args, timer, device, peak, started, sdpa_prefill)
    elif {"decode", "prefill"} & set(args.sections):
        triton_attention = optional_module("kernels.triton_attention")
        if triton_attention is not None:
            with torch.inference_mode():
                if "decode" in args.sections:
                    bench_decode(args, triton_attention.paged_attention, timer, device, peak)
                    bench_graph_plan_decode(args, triton_attention, timer, device)
                if "prefill" in args.sections:
                    bench_prefill(args, triton_attention.paged_attention, timer, device)
    if "norm" in args.sections and not args.sweep_configs:
        triton_norm = optional_module("kernels.triton_norm")
        if triton_norm is not None:
            with torch.inference_mode():
                bench_rms_norm(args, triton_norm, timer, device, peak)
    if "rotary" in args.sections and not args.sweep_configs:
        triton_rotary = optional_module("kernels.triton_rotary")
        if triton_rotary is not None:
            with torch.inference_mode():
                bench_rotary(args, triton_rotary, timer, device, peak)
    if "silu" in args.sections and not args.sweep_configs:
        triton_activation = optional_module("kernels.triton_activation")
        if triton_activation is not None:
            with torch.inference_mode():
                bench_silu_and_mul(args, triton_activation, timer, device, peak)
    if args.smoke:
        print(f"\n{SMOKE_BANNER}")
    if args.output:
        import json

        with open(args.output, "w") as f:
            json.dump({"device": str(device), "smoke": args.smoke, "peak_gbps": peak,
                       "peak_source": source, "tables": TABLES, "sweep": sweep}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
