"""Engine and HF transformers throughput on one device against the device's own limits, and
what the engine's CUDA graphs buy against --enforce-eager. A thin entry point: the benchmark is
`sloserve bench throughput --device ...` (engine/benchmarks/device_throughput/), the same options
(here --device defaults to auto)."""

from __future__ import annotations

from engine.benchmarks.device_throughput.benchmark import main

if __name__ == "__main__":
    raise SystemExit(main())
