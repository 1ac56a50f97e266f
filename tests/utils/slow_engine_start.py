"""`python -m tests.utils.slow_engine_start serve ...`: the server whose EngineCore holds its start for
SLOSERVE_TEST_START_HOLD_S seconds (default 600) just before the startup calibration, after the
weights are loaded, as a large model's load or graph capture would hold it; it logs HOLD_MARKER
when the hold begins (tests/entrypoints/test_clean_exit.py stops the server then).

The patch is made on import as the program, not only under `__main__`: the EngineCore process,
spawned, imports this module again (as `__mp_main__`), and the hold must happen there."""

from __future__ import annotations

import logging
import os
import sys
import time

import engine.runtime.engine_core as engine_core

HOLD_ENV = "SLOSERVE_TEST_START_HOLD_S"
HOLD_MARKER = "test hold: EngineCore's start is held"
_calibrate = engine_core.calibrate_at_startup


def _held_calibrate(*args, **kwargs):
    logging.getLogger(__name__).warning(HOLD_MARKER)
    until = time.monotonic() + float(os.environ.get(HOLD_ENV, "600"))
    while time.monotonic() < until:
        time.sleep(0.05)  # a signal's handler runs between two sleeps
    return _calibrate(*args, **kwargs)


# Only where this module is the program: the command run by the test (`__main__`) and its
# spawned EngineCore (`__mp_main__`); a test that imports HOLD_MARKER must not hold its own
# engines' starts.
if __name__ in ("__main__", "__mp_main__"):
    engine_core.calibrate_at_startup = _held_calibrate

if __name__ == "__main__":
    from engine.entrypoints.cli import main

    sys.exit(main())
