"""The GPU suite: what a GPU machine measures in its two calls (gpu_suite.sh)."""
