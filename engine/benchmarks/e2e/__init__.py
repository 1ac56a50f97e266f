"""The standing end-to-end benchmarks: `sloserve bench throughput|latency|serve|soak`."""
