"""Throughput: sloserve vs HF transformers, and the roofline figures. A thin entry point: the
benchmark is `sloserve bench throughput` (engine/benchmarks/e2e/throughput.py), the same parser."""

from __future__ import annotations

from engine.benchmarks.e2e.throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
