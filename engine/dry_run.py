"""Dry runs: a command goes as far as building its engine configuration, then exits 0.

A GPU call is scarce (a machine held briefly, 15 minutes in all): a renamed flag or a missing file must
fail on the CPU, in CI, not there. With ``SLOSERVE_DRY_RUN=1`` in the environment,
``bench/suite/gpu_suite.sh --dry-run`` runs every step with its exact full-size flags; each
entry point parses its arguments, reads the model folder's config and builds the engine
configuration as it would on the GPU (``engine.config.build_engine_config`` calls
``stop_if_dry_run``), prints one line saying so, and exits 0 before any weight, kernel or device
is touched. A command that builds no engine (the kernel benchmark) calls
``stop_if_dry_run_without_engine`` once its arguments are parsed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

DRY_RUN_ENV = "SLOSERVE_DRY_RUN"
# Every dry run's last line starts with this: the suite's test reads it per step.
DONE_PREFIX = "dry run: "


def enabled() -> bool:
    return os.environ.get(DRY_RUN_ENV) == "1"


def stop_if_dry_run(config: Any) -> None:
    """``config``: an engine.config.EngineConfig (not imported: engine.config calls this, and
    the import graph stays acyclic). Under a dry run: check the model folder can be read (its config.json, as the engine
    reads it first), print the configuration's gist and exit 0. Otherwise nothing."""
    if not enabled():
        return
    model = config.model
    if model.simulate is None:
        # Reads the folder's config.json through transformers, as the engine's loader does; a
        # missing or broken folder fails here. (Not through engine.runtime.model_setup, which
        # imports engine.config, the caller.)
        from engine.model_folder import load_hf_config

        hf = load_hf_config(model.model)
        layers = getattr(hf, "num_hidden_layers", "?")
    else:
        layers = "simulated"
    scheduler = config.scheduler
    _finish(f"engine configuration built: model {model.model} ({layers} layers), device "
            f"{model.device}, dtype {model.dtype}, load format {model.load_format}, "
            f"enforce_eager {model.enforce_eager}, budget {scheduler.max_num_batched_tokens} "
            f"tokens, policy {scheduler.policy}, tensor parallel {config.tensor_parallel_size}")


def stop_if_dry_run_without_engine(what: str) -> None:
    """For a command that builds no engine: under a dry run, say what would have run and exit
    0 (its arguments are parsed by now)."""
    if enabled():
        _finish(f"arguments parsed: {what}")


def _finish(message: str) -> None:
    print(DONE_PREFIX + message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # os._exit, not SystemExit: a benchmark's `finally` (or a server's lifespan) must not go on
    # to shut down engines and threads that were never started, and no `except BaseException`
    # may turn the stop into a failure.
    os._exit(0)
