"""The sampler alone: the batched sampler (workers/sample/sampler.py) against the per-row loop it
replaced, side by side in one run, for batches of random rows with and without top-p; with the
number of device-to-host reads each makes per call.

On a GPU every read waits for the device, and the engine reads the sampled tokens back every
step, so the reads per call are what counts there; on a CPU the times compare the host work.
Prints a table, then one JSON object (``--output`` also writes it). The figures are the script's to
print, never a test's to assert.

    python -m bench.diagnostics.sampler_overhead                      # vocab 32768, batches 1 16 64
    python -m bench.diagnostics.sampler_overhead --vocab 128256 --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from workers.sample.sampler import Sampler

# Each of these reads a tensor's value into Python (as tests/utils/host_sync.py lists them).
READING_METHODS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                   "__index__", "__array__")


class PerRowBaseline:
    """BASELINE, for comparison only: the per-row loop workers/sample/sampler.py had before the batched
    sampler (its random path, without processors or logprobs, which these rows do not use). Two
    reads per random row: the filtered mass, and the multinomial draw."""

    _SEED_STRIDE = 1_000_003

    def __init__(self, seed: int, device: torch.device) -> None:
        self._generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 output_indices: list[int]) -> list[int | None]:
        broken, tokens = torch.stack([(~torch.isfinite(logits.amax(dim=-1))).long(),
                                      logits.argmax(dim=-1)]).tolist()
        for row, (sp, index) in enumerate(zip(params, output_indices)):
            if broken[row]:
                tokens[row] = None
            elif not sp.greedy:
                tokens[row] = self._sample_row(logits[row], sp, index)
        return tokens

    def _sample_row(self, logits: torch.Tensor, sp: SamplingParams, index: int) -> int:
        logits = logits / sp.temperature
        if 0 < sp.top_k < logits.numel():
            kth = torch.topk(logits, sp.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if sp.min_p > 0.0:
            kept = probs.masked_fill(probs < sp.min_p * probs.max(), 0.0)
            probs = kept / kept.sum()
        if sp.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before >= sp.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            probs = probs / probs.sum()
        total = float(probs.sum())
        if not 0.0 < total < float("inf"):
            raise ValueError(f"no token can be sampled: the filtered probabilities sum to {total}")
        if sp.seed is not None:
            generator = torch.Generator(probs.device)
            generator.manual_seed((sp.seed * self._SEED_STRIDE + index) % 2**63)
        else:
            generator = self._generator
        return int(torch.multinomial(probs, 1, generator=generator).item())


class ReadCounter:
    """Counts the calls of READING_METHODS while it is active (a method calling another is one
    read)."""

    def __init__(self) -> None:
        self.count = 0
        self._originals: dict[str, Callable[..., Any]] = {}
        self._inside = False

    def __enter__(self) -> ReadCounter:
        for name in READING_METHODS:
            original = getattr(torch.Tensor, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(torch.Tensor, name, self._wrap(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self._inside:
                self.count += 1
            outer, self._inside = self._inside, True
            try:
                return original(tensor, *args, **kwargs)
            finally:
                self._inside = outer

        return counted


def batch_params(rows: int, top_p: bool) -> list[SamplingParams]:
    """Random rows as a serving batch mixes them: every other one seeded."""
    return [SamplingParams(temperature=0.8, top_p=0.9 if top_p else 1.0,
                           seed=row if row % 2 else None) for row in range(rows)]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(sample: Callable[[], object], device: torch.device,
            repeats: int) -> tuple[float, float]:
    """Median wall and CPU milliseconds of one call (after one warm-up call). The CPU time (this
    process's, every thread) is the steadier figure on a shared machine, where a call longer
    than a time slice waits for the others; on a GPU the wall time is the one that counts."""
    sample()
    wall, cpu = [], []
    for _ in range(repeats):
        _synchronize(device)
        started, started_cpu = time.perf_counter(), time.process_time()
        sample()
        _synchronize(device)
        wall.append((time.perf_counter() - started) * 1e3)
        cpu.append((time.process_time() - started_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def run(batches: list[int], vocab: int, device: torch.device, repeats: int) -> dict:
    results = []
    for top_p in (False, True):
        for rows in batches:
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
            logits = logits.to(device)
            params = batch_params(rows, top_p)
            indices = list(range(rows))
            entry: dict[str, Any] = {"rows": rows, "top_p": top_p}
            for name, sampler in (("per_row", PerRowBaseline(0, device)),
                                  ("batched", Sampler(0, device))):
                with ReadCounter() as reads:
                    sampler(logits, params, indices)
                entry[f"{name}_reads"] = reads.count
                wall, cpu = measure(lambda: sampler(logits, params, indices), device, repeats)
                entry[f"{name}_ms"], entry[f"{name}_cpu_ms"] = round(wall, 3), round(cpu, 3)
            entry["speedup"] = round(entry["per_row_ms"] / entry["batched_ms"], 2)
            entry["cpu_speedup"] = round(entry["per_row_cpu_ms"] / entry["batched_cpu_ms"], 2)
            results.append(entry)
    return {"device": str(device), "vocab": vocab, "repeats": repeats,
            "torch_threads": torch.get_num_threads(), "results": results}


def table(report: dict) -> str:
    lines = [f"sampler alone, vocab {report['vocab']}, {report['device']} "
             f"({report['torch_threads']} torch threads), median of {report['repeats']} calls "
             f"(random rows, temperature 0.8, every other one seeded)",
             "| rows | top_p | per-row ms (cpu ms) | batched ms (cpu ms) | speed-up (cpu) | "
             "per-row reads | batched reads |",
             "|---:|:---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['rows']} | {'0.9' if r['top_p'] else '-'} | "
                     f"{r['per_row_ms']} ({r['per_row_cpu_ms']}) | "
                     f"{r['batched_ms']} ({r['batched_cpu_ms']}) | "
                     f"{r['speedup']}x ({r['cpu_speedup']}x) | {r['per_row_reads']} | "
                     f"{r['batched_reads']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared machine a parallel op "
                             "waits a whole time slice for a descheduled worker thread, which "
                             "measures the machine's load, not the sampler)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat")
    parser.add_argument("--output", type=Path, metavar="PATH", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.vocab, args.repeats = [1, 4], 64, 1
    torch.set_num_threads(args.threads)
    report = run(args.batches, args.vocab, torch.device(args.device), args.repeats)
    print(table(report), file=sys.stderr)
    print(json.dumps(report))
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
