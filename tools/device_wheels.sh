#!/usr/bin/env bash
# Kept for old notes: the wheels a GPU machine lacks are resolved by tools/device_wheels.py.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
exec python3 -m tools.device_wheels "$@"
