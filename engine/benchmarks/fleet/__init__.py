"""The fleet benchmarks: `sloserve bench run --replicas N --router ...` (fleet_run.py) and its
trace family `fleet-bursts` (bursts.py)."""
