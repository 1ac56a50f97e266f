#!/usr/bin/env bash
# The GPU suite, also `sloserve bench suite OUT_DIR [--core] [--only STEP]...`: the script is
# engine/benchmarks/suite/gpu_suite.sh (its header says what each call runs).
exec bash "$(dirname "$0")/../../engine/benchmarks/suite/gpu_suite.sh" "$@"
