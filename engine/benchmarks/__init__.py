"""The benchmark library behind `sloserve bench`: what the scripts in bench/ and the tests share.

- `cli`: the `sloserve bench` parser each family adds its subcommands to; `standalone`: the
  same parser for a family's script in bench/; `server`: a `sloserve serve` a benchmark starts;
- `attainment/`: SLO-attainment and goodput runs (traces, workloads, runners in process and over
  HTTP, results, reports, peers): `sloserve bench trace|run|sweep|report`;
- `e2e/`: the standing end-to-end benchmarks, `sloserve bench throughput|latency|serve|soak`,
  each also a script in bench/e2e/;
- `device_throughput/`: `sloserve bench throughput --device`, a real shape on one device against
  its measured limits, CUDA graphs against eager, HF beside it;
- `inputs/`: what a benchmark feeds the engine: seeded prompts, arrivals on a schedule, random
  checkpoints and a small tokenizer, real model shapes without weights (`sloserve bench shape`);
- `measure/`: how it measures and reports: the machine's limits, the roofline, the engine's steps
  (through `EngineCore.step_observers`), percentiles, figures written as they are measured;
- `reference/`: what a run is checked against: HF transformers' greedy output, and where two
  greedy runs first diverge.
"""
