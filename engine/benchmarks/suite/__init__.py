"""The GPU suite (`sloserve bench suite`, `bash bench/suite/gpu_suite.sh`): gpu_suite.sh runs its
steps under per-step time limits and one deadline; smoke.py and equality.py are two of its steps.
The throughput step and the summary are still bench/suite/gpu_throughput.py and gpu_summary.py,
which use the end-to-end benchmarks of bench/e2e."""
