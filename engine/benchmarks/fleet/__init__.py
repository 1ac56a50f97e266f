"""Benchmarks of the fleet router (engine.fleet)."""
