"""Launch-config sweep of the Triton paged attention: ``python -m bench.kernels.gpu_kernels
--sweep-configs``. On a GPU it times each candidate ``DecodeLaunch`` / ``PrefillLaunch``
(kernels.triton_attention) on the benchmark's decode and prefill shapes against SDPA, checks
every output against SDPA's (a fast wrong config is not a result), and prints the ratio tables,
the best config per shape and the one config per kind that maximises the minimum ratio over the
shapes: the one a default should be, as a literal ready to paste over
``DEFAULT_ATTENTION_CONFIG``.

The candidates are a short list reasoned for Hopper rather than the whole grid, so that the sweep
compiles and runs within about five minutes on an H100 (a compile is ~1-2 s per config and
variant; a decode config compiles its split and unsplit variants):

- decode (memory-bound; a program's rows are its group's heads, 16 for Llama-3.1-8B's group of
  4, so the dot never reaches a warpgroup MMA's 64 rows): key tiles 32/64/128 with 2-8 warps and
  1-4 stages, more bytes in flight per program against fewer programs per SM. Pruned: 8 warps
  on a 16 x 32 tile (most threads idle), 2 warps on a 128-key tile (register spills), 4 stages
  of 128-key K and V tiles (256 KiB, over the 227 KiB of shared memory).
- prefill (compute-bound): 64-row tiles with 4 warps (one warpgroup of 64 rows), 128-row tiles
  with 4 or 8 warps, key tiles 32-128 and 2-4 stages; the configs of Triton's Hopper
  flash-attention tutorial (128 x 64/128, 8 warps, 3-4 stages) among them. Pruned: 8 warps on
  64 rows (a warpgroup MMA needs 64 rows per warpgroup) and 4 stages of 128-key tiles.

Candidates come most promising first, decode and prefill interleaved, so that ``--sweep-until-s``
(no new config starts after that many seconds from the script's start) leaves both kinds with
their best guesses measured. A config that fails to compile or launch (out of shared memory, say)
is reported as failed and the sweep goes on.

All decode shapes share one paged cache sized for the largest (views of its first rows and
blocks), so the sweep needs the memory of one large shape, not of all of them together.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from bench.kernels.harness import (TOLERANCE, Timer, build_batch, decode_subset, fits,
                                   gathered, kv_bytes_per_token, max_diff, print_table, release)
from kernels import triton_attention
from kernels.triton_attention import (DEFAULT_ATTENTION_CONFIG, AttentionLaunchConfig,
                                      DecodeLaunch, PrefillLaunch)

_DEFAULT = DEFAULT_ATTENTION_CONFIG

# Most promising first (see the module docstring); the default first of all, as the baseline.
DECODE_CANDIDATES: tuple[DecodeLaunch, ...] = (
    _DEFAULT.decode,
    DecodeLaunch(tile_n=64, num_warps=4, num_stages=3),
    DecodeLaunch(tile_n=64, num_warps=4, num_stages=2),
    DecodeLaunch(tile_n=128, num_warps=4, num_stages=2),
    DecodeLaunch(tile_n=64, num_warps=8, num_stages=3),
    DecodeLaunch(tile_n=128, num_warps=8, num_stages=2),
    DecodeLaunch(tile_n=32, num_warps=4, num_stages=4),
    DecodeLaunch(tile_n=64, num_warps=4, num_stages=4),
    DecodeLaunch(tile_n=32, num_warps=2, num_stages=3),
    DecodeLaunch(tile_n=64, num_warps=2, num_stages=3),
    DecodeLaunch(tile_n=128, num_warps=4, num_stages=3),
    DecodeLaunch(tile_n=128, num_warps=8, num_stages=3),
    DecodeLaunch(tile_n=32, num_warps=4, num_stages=2),
    DecodeLaunch(tile_n=32, num_warps=2, num_stages=2),
    DecodeLaunch(tile_n=32, num_warps=2, num_stages=4),
    DecodeLaunch(tile_n=64, num_warps=2, num_stages=2),
    DecodeLaunch(tile_n=64, num_warps=2, num_stages=4),
    DecodeLaunch(tile_n=64, num_warps=8, num_stages=2),
    DecodeLaunch(tile_n=64, num_warps=8, num_stages=4),
    # No pipelining: many small programs per SM hide the latency instead.
    DecodeLaunch(tile_n=32, num_warps=4, num_stages=1),
    DecodeLaunch(tile_n=64, num_warps=4, num_stages=1),
    DecodeLaunch(tile_n=128, num_warps=4, num_stages=1),
)
PREFILL_CANDIDATES: tuple[PrefillLaunch, ...] = (
    _DEFAULT.prefill,
    PrefillLaunch(block_m=128, tile_n=64, num_warps=8, num_stages=3),
    PrefillLaunch(block_m=128, tile_n=128, num_warps=8, num_stages=3),
    PrefillLaunch(block_m=128, tile_n=64, num_warps=8, num_stages=4),
    PrefillLaunch(block_m=128, tile_n=64, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=64, tile_n=64, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=64, tile_n=128, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=128, tile_n=128, num_warps=8, num_stages=2),
    PrefillLaunch(block_m=128, tile_n=64, num_warps=8, num_stages=2),
    PrefillLaunch(block_m=64, tile_n=64, num_warps=4, num_stages=4),
    PrefillLaunch(block_m=64, tile_n=32, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=128, tile_n=32, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=64, tile_n=128, num_warps=4, num_stages=3),
    PrefillLaunch(block_m=128, tile_n=64, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=128, tile_n=64, num_warps=4, num_stages=4),
    PrefillLaunch(block_m=128, tile_n=128, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=128, tile_n=32, num_warps=8, num_stages=3),
    PrefillLaunch(block_m=64, tile_n=32, num_warps=4, num_stages=2),
    PrefillLaunch(block_m=64, tile_n=32, num_warps=4, num_stages=4),
    PrefillLaunch(block_m=128, tile_n=32, num_warps=4, num_stages=2),
)
# --smoke: two configs per kind with other tiles than the default's, so the interpreter runs
# another tiling through the sweep's code path.
SMOKE_DECODE_CANDIDATES = (_DEFAULT.decode, DecodeLaunch(tile_n=64, num_warps=4, num_stages=2))
SMOKE_PREFILL_CANDIDATES = (_DEFAULT.prefill,
                            PrefillLaunch(block_m=128, tile_n=32, num_warps=8, num_stages=3))

Launch = DecodeLaunch | PrefillLaunch


def label(launch: Launch) -> str:
    """A short name without spaces: t<keys>w<warps>s<stages>, prefill prefixed by m<rows>."""
    rows = f"m{launch.block_m}" if isinstance(launch, PrefillLaunch) else ""
    return f"{rows}t{launch.tile_n}w{launch.num_warps}s{launch.num_stages}"


@dataclass
class Reference:
    """One shape: how to call the kernel under a config, and SDPA's answer and time."""

    name: str
    call: Callable[[AttentionLaunchConfig], torch.Tensor]
    expected: torch.Tensor
    sdpa_ms: float
    work: float  # bytes moved (decode) or FLOPs (prefill) per call
    long_context: bool = False  # held to the bandwidth target


@dataclass
class Measured:
    ms: float
    rate: float  # GB/s (decode) or TFLOP/s (prefill)
    ratio: float  # sdpa_ms / ms
    diff: float


@dataclass
class ConfigResult:
    launch: Launch
    status: str = "ok"  # "ok", "WRONG: ..." or "failed: ..."
    seconds: float = 0.0  # compiles included
    shapes: dict[str, Measured] = field(default_factory=dict)

    def min_ratio(self) -> float:
        return min((m.ratio for m in self.shapes.values()), default=math.nan)


class KindSweep:
    """The sweep of one kind of launch (decode or prefill) over that kind's shapes."""

    def __init__(self, kind: str, candidates: tuple[Launch, ...], unit: str,
                 build: Callable[[], list[Reference]], skipped: list[str]) -> None:
        self.kind, self.candidates, self.unit = kind, candidates, unit
        self._build = build
        self.references: list[Reference] | None = None  # built when the first config runs
        self.skipped = skipped  # shape notes (did not fit in memory)
        self.results: list[ConfigResult] = []

    def config(self, launch: Launch) -> AttentionLaunchConfig:
        return dataclasses.replace(_DEFAULT, **{self.kind: launch})

    def run(self, launch: Launch, timer: Timer, dtype: torch.dtype) -> ConfigResult:
        if self.references is None:
            self.references = self._build()
        result = ConfigResult(launch)
        started = time.perf_counter()
        config = self.config(launch)
        for ref in self.references:
            try:
                call = partial(ref.call, config)
                # The first call compiles; an output off SDPA's ends the config's run.
                diff = max_diff(call(), ref.expected)
                if not math.isfinite(diff) or diff > TOLERANCE[dtype]:
                    result.status = (f"WRONG: max|diff| {diff:.3g} > {TOLERANCE[dtype]:g} at "
                                     f"{ref.name}")
                    break
                ms = timer(call)
            except Exception as error:  # noqa: BLE001 - any failure of a config is its result
                first_line = (str(error).strip().splitlines() or [""])[0][:120]
                result.status = f"failed at {ref.name}: {type(error).__name__}: {first_line}"
                break
            rate = ref.work / (ms / 1000) / (1e9 if self.unit == "GB/s" else 1e12)
            result.shapes[ref.name] = Measured(ms, rate, ref.sdpa_ms / ms, diff)
        result.seconds = time.perf_counter() - started
        self.results.append(result)
        return result

    def good(self) -> list[ConfigResult]:
        return [r for r in self.results if r.status == "ok"]

    def best(self) -> ConfigResult | None:
        """The config whose worst shape is best: the one a default should be."""
        return max(self.good(), key=ConfigResult.min_ratio, default=None)


# ---------------------------------------------------------------------------------------------
# The shapes (those of bench_decode and bench_prefill)


def decode_references(args: argparse.Namespace, device: torch.device, timer: Timer,
                      skipped: list[str]) -> list[Reference]:
    dtype, hq, hkv, d = args.dtype, args.num_heads, args.num_kv_heads, args.head_dim
    esize = torch.empty((), dtype=dtype).element_size()
    scale = 1 / math.sqrt(d)
    most, longest = max(args.batches), max(args.contexts)
    kv = most * longest * kv_bytes_per_token(hkv, d, dtype)
    # The shared cache, the largest shape's gathered copy, queries and outputs.
    if note := fits(device, 2 * kv + 4 * most * hq * d * esize + (64 << 20)):
        skipped.append(f"every decode shape {note} (pass smaller --batches / --contexts)")
        return []
    shared = build_batch([longest] * most, [], hq, hkv, d, args.block_size, dtype, device,
                         args.seed)
    references = []
    for batch_size in args.batches:
        for ctx in args.contexts:
            sub = decode_subset(shared, batch_size, ctx)
            k, v = gathered(sub, 0, batch_size, ctx)
            sdpa_call = partial(F.scaled_dot_product_attention, sub.query.unsqueeze(2), k, v,
                                scale=scale, enable_gqa=True)
            sdpa_ms = timer(sdpa_call)
            expected = sdpa_call().squeeze(2)
            del k, v, sdpa_call
            release(device)

            def call(config: AttentionLaunchConfig, sub: Any = sub) -> torch.Tensor:
                return triton_attention.paged_attention(
                    sub.query, sub.key, sub.value, sub.key_cache, sub.value_cache, sub.meta,
                    scale, config=config)

            moved = batch_size * ctx * kv_bytes_per_token(hkv, d, dtype) \
                + 2 * batch_size * hq * d * esize  # K/V read + query read + output written
            references.append(Reference(f"{batch_size}x{ctx}", call, expected, sdpa_ms, moved,
                                        long_context=ctx >= args.long_context))
    return references


def prefill_references(args: argparse.Namespace, device: torch.device, timer: Timer,
                       sdpa_prefill: Callable[..., tuple[Callable[[], torch.Tensor], str]],
                       skipped: list[str]) -> list[Reference]:
    dtype, hq, hkv, d = args.dtype, args.num_heads, args.num_kv_heads, args.head_dim
    scale = 1 / math.sqrt(d)
    references = []
    for chunk in args.chunks:
        for prefix in args.prefixes:
            ctx = chunk + prefix
            if note := fits(device, 4 * ctx * kv_bytes_per_token(hkv, d, dtype) + (64 << 20)):
                skipped.append(f"prefill {chunk}+{prefix}: {note}")
                continue
            batch = build_batch([], [(chunk, prefix)], hq, hkv, d, args.block_size, dtype,
                                device, args.seed)
            k, v = gathered(batch, 0, 1, ctx)
            q = batch.query.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, chunk, D]
            sdpa_call, _ = sdpa_prefill(q, k, v, prefix, scale)
            sdpa_ms = timer(sdpa_call)
            expected = sdpa_call().squeeze(0).transpose(0, 1)
            del k, v, q, sdpa_call
            release(device)

            def call(config: AttentionLaunchConfig, batch: Any = batch) -> torch.Tensor:
                return triton_attention.paged_attention(
                    batch.query, batch.key, batch.value, batch.key_cache, batch.value_cache,
                    batch.meta, scale, config=config)

            # Query i of the chunk sees prefix + i + 1 keys; 2 matmuls x 2 FLOPs per MAC.
            flops = 4 * hq * d * (chunk * prefix + chunk * (chunk + 1) // 2)
            references.append(Reference(f"{chunk}+{prefix}", call, expected, sdpa_ms, flops))
    return references


# ---------------------------------------------------------------------------------------------
# The run and its report


def interleaved(sweeps: list[KindSweep]) -> list[tuple[KindSweep, Launch]]:
    """Each kind's candidates in order, the kinds taking turns."""
    queue: list[tuple[KindSweep, Launch]] = []
    for i in range(max((len(s.candidates) for s in sweeps), default=0)):
        queue += [(s, s.candidates[i]) for s in sweeps if i < len(s.candidates)]
    return queue


def run_sweep(args: argparse.Namespace, timer: Timer, device: torch.device, peak: float,
              started: float,
              sdpa_prefill: Callable[..., tuple[Callable[[], torch.Tensor], str]]
              ) -> dict[str, Any]:
    """Sweep the candidates of the kinds in ``args.sections``; print the report and return it
    as JSON-ready data. ``started``: the script's start (perf_counter), for --sweep-until-s."""
    sweeps: list[KindSweep] = []
    decode_skipped: list[str] = []
    prefill_skipped: list[str] = []
    if "decode" in args.sections:
        sweeps.append(KindSweep(
            "decode", SMOKE_DECODE_CANDIDATES if args.smoke else DECODE_CANDIDATES, "GB/s",
            lambda: decode_references(args, device, timer, decode_skipped), decode_skipped))
    if "prefill" in args.sections:
        sweeps.append(KindSweep(
            "prefill", SMOKE_PREFILL_CANDIDATES if args.smoke else PREFILL_CANDIDATES,
            "TFLOP/s",
            lambda: prefill_references(args, device, timer, sdpa_prefill, prefill_skipped),
            prefill_skipped))
    queue = interleaved(sweeps)
    print(f"\nsweep: {len(queue)} configs ("
          + ", ".join(f"{len(s.candidates)} {s.kind}" for s in sweeps) + ")"
          + (f", none started after {args.sweep_until_s:g} s" if args.sweep_until_s is not None
             else ""))
    ran = 0
    with torch.inference_mode():
        for sweep, launch in queue:
            if (args.sweep_until_s is not None
                    and time.perf_counter() - started >= args.sweep_until_s):
                break
            result = sweep.run(launch, timer, args.dtype)
            ran += 1
            print(f"  {sweep.kind} {label(launch)}: {result.status}, min ratio "
                  f"{result.min_ratio():.2f}x, {result.seconds:.1f} s", flush=True)
    stopped = ran < len(queue)
    if stopped:
        print(f"\nSTOPPED: --sweep-until-s {args.sweep_until_s:g} reached after {ran} of "
              f"{len(queue)} configs; the report covers those")
    for sweep in sweeps:
        report_kind(sweep, args, peak)
    chosen = AttentionLaunchConfig(
        decode=_best_or_default(sweeps, "decode"), prefill=_best_or_default(sweeps, "prefill"))
    print("\nThe config that maximises the minimum ratio to SDPA over the shapes, per kind "
          "(a kind with no measured config keeps the default's half); paste it over "
          "DEFAULT_ATTENTION_CONFIG in kernels/triton_attention.py only from a GPU run:")
    print(f"DEFAULT_ATTENTION_CONFIG = {chosen.literal()}")
    if chosen == _DEFAULT:
        print("(the same as the current default)")
    return {"stopped_early": stopped, "configs_run": ran, "configs_queued": len(queue),
            "elapsed_s": time.perf_counter() - started, "literal": chosen.literal(),
            "chosen": dataclasses.asdict(chosen),
            "kinds": {s.kind: kind_json(s) for s in sweeps}}


def _best_or_default(sweeps: list[KindSweep], kind: str) -> Any:
    sweep = next((s for s in sweeps if s.kind == kind), None)
    best = sweep.best() if sweep else None
    return best.launch if best else getattr(_DEFAULT, kind)


def report_kind(sweep: KindSweep, args: argparse.Namespace, peak: float) -> None:
    refs = sweep.references or []
    names = [r.name for r in refs]
    shape_words = ("batch x context" if sweep.kind == "decode" else "chunk + prefix")
    rows = []
    for result in sweep.results:
        digits = 0 if sweep.kind == "decode" else 1
        cells = [f"{m.rate:.{digits}f}/{m.ratio:.2f}x" if m else "-"
                 for m in (result.shapes.get(n) for n in names)]
        worst = max((m.diff for m in result.shapes.values()), default=math.nan)
        # One word per cell (the tables split on spaces); the whole reason is in the JSON.
        status = result.status.replace(" ", "_")
        rows.append([label(result.launch), *cells, f"{result.min_ratio():.2f}x",
                     f"{worst:.1e}", f"{result.seconds:.1f}",
                     status if len(status) <= 48 else status[:45] + "..."])
    print_table(f"{sweep.kind} sweep: {sweep.unit}/ratio to SDPA per shape ({shape_words}), "
                f"{args.num_heads} q heads / {args.num_kv_heads} KV heads, head_dim "
                f"{args.head_dim}, {str(args.dtype).removeprefix('torch.')}; min = the worst "
                f"shape's ratio; s = seconds for the config, compiles included",
                ["config", *names, "min", "max|diff|", "s", "status"], rows)
    for note in sweep.skipped:
        print(f"  {note}")
    if not sweep.good():
        print(f"{sweep.kind}: " + ("no config measured without failing" if sweep.results
                                   else "no config run"))
        return
    default = next((r for r in sweep.good() if r.launch == getattr(_DEFAULT, sweep.kind)), None)
    best_rows = []
    for ref in refs:
        best = max(sweep.good(), key=lambda r, n=ref.name: r.shapes[n].ratio)
        m = best.shapes[ref.name]
        best_rows.append([ref.name, label(best.launch), f"{m.ms:.3f}", f"{ref.sdpa_ms:.3f}",
                          f"{m.rate:.1f}", f"{m.ratio:.2f}x",
                          f"{default.shapes[ref.name].ratio:.2f}x" if default else "-"])
    print_table(f"{sweep.kind}: the best config per shape ({sweep.unit}; ratio = sdpa_ms / ms)",
                ["shape", "config", "ms", "sdpa_ms", sweep.unit, "ratio", "default"],
                best_rows)
    best = sweep.best()
    assert best is not None
    line = (f"\n{sweep.kind}: best over all shapes {label(best.launch)}, min ratio "
            f"{best.min_ratio():.2f}x")
    if default:
        line += f" (default {label(default.launch)}: {default.min_ratio():.2f}x)"
    print(line)
    long_rows = [best.shapes[r.name].rate for r in refs if r.long_context]
    if sweep.kind == "decode" and long_rows:
        print(f"decode: {label(best.launch)} reaches {100 * min(long_rows) / peak:.1f}% of peak "
              f"bandwidth ({peak:.0f} GB/s) at worst on contexts >= {args.long_context}")


def kind_json(sweep: KindSweep) -> dict[str, Any]:
    refs = sweep.references or []
    best = sweep.best()
    return {
        "unit": sweep.unit,
        "shapes": [{"name": r.name, "sdpa_ms": r.sdpa_ms, "long_context": r.long_context}
                   for r in refs],
        "skipped": sweep.skipped,
        "configs": [{"label": label(r.launch), "launch": dataclasses.asdict(r.launch),
                     "status": r.status, "seconds": r.seconds,
                     "min_ratio": r.min_ratio() if r.shapes else None,
                     "shapes": {n: dataclasses.asdict(m) for n, m in r.shapes.items()}}
                    for r in sweep.results],
        "best": label(best.launch) if best else None,
    }
