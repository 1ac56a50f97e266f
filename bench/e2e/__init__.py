"""Benchmarks of the whole engine: throughput, latency, preemption, serving overhead, soak."""
