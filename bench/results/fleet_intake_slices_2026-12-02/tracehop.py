"""Temporary timing lines (not kept): one JSON line per event, per process."""
import json, os, time
_F = None
def stamp(ev, arr, **kw):
    global _F
    if _F is None:
        _F = open(f"/tmp/fl/hop/trace_{os.getpid()}.jsonl", "a", buffering=1)
    _F.write(json.dumps({"ev": ev, "arr": arr, "t": time.time(), **kw}) + "\n")
