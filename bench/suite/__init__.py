"""The GPU suite, what a GPU machine measures in its two calls (`bash bench/suite/gpu_suite.sh`):
gpu_suite.sh runs its steps under per-step time limits and one deadline; gpu_smoke.py and
gpu_equality.py are two of its steps, gpu_summary.py its last (OUT_DIR/summary.md and
suite.json), and dry_run.py the launcher its --dry-run runs every step through. The throughput
steps run the device throughput benchmark (gpu_throughput.py, which is `sloserve bench
throughput --device`); the other benchmark steps are `sloserve` commands and the end-to-end
benchmarks of bench/e2e."""
