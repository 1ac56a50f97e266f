"""The GPU suite (`sloserve bench suite`, `bash bench/suite/gpu_suite.sh`): gpu_suite.sh runs its
steps under per-step time limits and one deadline; smoke.py and equality.py are two of its steps,
summary.py its last (OUT_DIR/summary.md and suite.json). The throughput steps run the device
throughput benchmark (engine/benchmarks/device_throughput/); the other benchmark steps are the
end-to-end benchmarks of bench/e2e."""
