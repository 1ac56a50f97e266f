"""The GPU-timed simulation: the real EngineCore, scheduler, monitor thread, shared-memory
signal, vote and unwind, over an executor whose steps take the time a step-time profile gives
instead of running a model (`sloserve serve --simulate PROFILE`, `sloserve bench run
--simulate PROFILE`). It is how a policy is judged at GPU time scales on a machine without one.
"""

from engine.simulation.profile import StepTimeProfile, load_profile, shipped_profiles

__all__ = ["StepTimeProfile", "load_profile", "shipped_profiles"]
