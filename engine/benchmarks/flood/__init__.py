"""`sloserve bench flood`: ten times a server's queue bound at once (engine/benchmarks/flood/flood.py)."""
