"""The GPU suite: what a lent GPU machine measures in its two calls (gpu_suite.sh)."""
