"""The benchmark library behind `sloserve bench`: what the scripts in bench/ and the tests share.

- `attainment/`: SLO-attainment and goodput runs (traces, workloads, runners in process and over
  HTTP, the server a run starts, results, reports, peers);
- `throughput`, `latency`, `serve_overhead`, `soak` (+ `soak_clients`): the standing end-to-end
  benchmarks (`sloserve bench throughput|latency|serve|soak`), each also a script in bench/e2e/
  (`standalone`);
- `random_prompts`, `step_log`: seeded token prompts; the engine's steps as they run, kept through
  `EngineCore.step_observers`;
- `model_shapes`: real model shapes without weights (`sloserve bench shape`);
- `random_checkpoints`: seeded random checkpoints and a small tokenizer trained here;
- `figures`: a benchmark's figures as JSON lines, written as they are measured;
- `arrivals`: requests handed to an engine on a schedule;
- `stats`: the percentile every benchmark reports.
"""
