"""The GPU suite's dry run: a step goes as far as building its engine configuration, then exits 0.

    python -m bench.suite.dry_run MODULE [ARGS...]    # `python -m MODULE ARGS...`, up to the
                                                      # engine configuration

A GPU call is scarce (a machine held briefly, 15 minutes in all): a renamed flag or a missing file
must fail on the CPU, in CI, not there. ``bash bench/suite/gpu_suite.sh OUT --dry-run`` runs
every step of both calls with its exact full-size flags through this launcher. It runs MODULE as
``python -m`` would, after wrapping ``engine.config.build_engine_config`` as that module is
imported: the entry point parses its arguments, reads the model folder's config and builds the
engine configuration as it would on the GPU; the wrapper then prints one line saying so
(``dry run: engine configuration built: ...``) and exits 0 before any weight, kernel or device
is touched. The product knows nothing of it.

Two product entry points would touch the device (or start servers) before they build an engine
configuration; ``STOPS`` stops each of them at its first configuration instead: the device
throughput benchmark (it measures the device's limits first) and ``sloserve bench run`` (it
calibrates, starts servers). The suite's own steps (bench/) ask ``enabled()``; a command that
builds no engine (the kernel benchmark, its launch-config sweep) calls
``stop_if_dry_run_without_engine`` once its arguments are parsed. A server a step would start
(the stream-gaps step's) is started through the launcher too (``launcher_command``).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

# Set by the launcher in its own environment (so its children inherit it): the suite's own steps
# read it through enabled(). It is not a switch of its own: the launcher is.
DRY_RUN_ENV = "SLOSERVE_DRY_RUN"
# Every dry run's last line starts with this: the suite's test reads it per step.
DONE_PREFIX = "dry run: "
USAGE = "usage: python -m bench.suite.dry_run MODULE [ARGS...]"


def enabled() -> bool:
    """Whether this process runs under the launcher (or was started by one that does)."""
    return os.environ.get(DRY_RUN_ENV) == "1"


def launcher_command(command: list[str]) -> list[str]:
    """``[python, "-m", MODULE, *args]`` run through the launcher instead."""
    if len(command) < 3 or command[1] != "-m":
        raise ValueError(f"not a `python -m MODULE` command: {command}")
    return [command[0], "-m", "bench.suite.dry_run", *command[2:]]


def stop_at(config: Any) -> NoReturn:
    """``config``: an engine.config.EngineConfig. Check the model folder can be read (its
    config.json, as the engine reads it first), print the configuration's gist and exit 0."""
    model = config.model
    if model.simulate is None:
        # Reads the folder's config.json through transformers, as the engine's loader does; a
        # missing or broken folder fails here.
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


def _finish(message: str) -> NoReturn:
    print(DONE_PREFIX + message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # os._exit, not SystemExit: a benchmark's `finally` (or a server's lifespan) must not go on
    # to shut down engines and threads that were never started, and no `except BaseException`
    # may turn the stop into a failure.
    os._exit(0)


# -- the stops, each applied to its module as the module is imported ---------------------------


def _stop_after_building(config_module: ModuleType) -> None:
    """engine.config: build_engine_config builds the configuration, then the run stops there."""
    build = config_module.build_engine_config

    def build_then_stop(*args: Any, **kwargs: Any) -> NoReturn:
        stop_at(build(*args, **kwargs))

    build_then_stop.__doc__ = build.__doc__
    config_module.build_engine_config = build_then_stop


def _stop_before_measuring(benchmark: ModuleType) -> None:
    """The device throughput benchmark (`sloserve bench throughput --device`, the suite's
    throughput steps): it measures the device's limits before its first engine. Instead: write
    the model folder and build the first engine's configuration as the GPU run would, with the
    device named and no device touched."""
    from engine.benchmarks.device_throughput import engine_steps as steps
    from engine.config import build_engine_config

    def first_configuration(args: argparse.Namespace, log: Any, wall_started: float) -> NoReturn:
        sizes = {key: getattr(args, key) for key in benchmark.FULL}
        device = "cuda" if args.device == "auto" else args.device
        with tempfile.TemporaryDirectory(prefix="sloserve-gpu-throughput-") as tmp:
            model_dir, _ = benchmark.prepare_model(args, Path(tmp))
            limits = steps.engine_limits(sizes, steps.kv_groups_of(model_dir))
            stop_at(build_engine_config(
                model_dir, load_format="dummy", device=device, dtype=args.dtype,
                enable_prefix_caching=False, max_num_batched_tokens=sizes["prefill_len"],
                max_num_seqs=limits["max_num_seqs"], max_model_len=limits["max_model_len"],
                block_size=steps.BLOCK_SIZE, num_kv_blocks=limits["num_kv_blocks"],
                startup_calibration=False, seed=args.seed, enforce_eager=args.enforce_eager))

    benchmark.measure = first_configuration


def _stop_before_the_runs(cli: ModuleType) -> None:
    """`sloserve bench run` (the suite's SLO bursts): it calibrates and starts servers or engines
    before it builds a configuration. Instead: build the configuration the first run would use,
    as the GPU run would. The TTFT line is not read: the dry run's calibrate step writes none."""
    from engine.config import build_engine_config

    cmd_run = cli._cmd_run

    def first_configuration(args: argparse.Namespace) -> int:
        cli._check_busy(args)
        if getattr(args, "replicas", None):
            return cmd_run(args)  # a fleet: each replica stops at its own configuration
        from engine.entrypoints.default_model import model_path_or_default

        model = model_path_or_default(args.model)
        asked = args.budgets or cli.DEFAULT_BUDGETS
        budgets = [int(b) for b in asked if b != "large"]
        if "large" in asked:
            # The real run sizes it from its traces (larger than any prompt, which the TTFT
            # line sizes); the model's longest context bounds it.
            from transformers import AutoConfig

            budgets.append(args.max_model_len or getattr(AutoConfig.from_pretrained(model),
                                                         "max_position_embeddings", 2048))
        overrides: dict[str, Any] = {"dtype": args.dtype, "enable_prefix_caching": False,
                                     "enforce_eager": args.enforce_eager}
        for key in ("device", "load_format"):
            if getattr(args, key) != "auto":
                overrides[key] = getattr(args, key)
        for key in ("num_kv_blocks", "max_model_len", "simulate"):
            if getattr(args, key):
                overrides[key] = getattr(args, key)
        stop_at(build_engine_config(model, max_num_batched_tokens=max(budgets), **overrides))

    cli._cmd_run = first_configuration


# Module name -> the stop applied to it as it is imported (before any other module can import a
# name from it).
STOPS: dict[str, Callable[[ModuleType], None]] = {
    "engine.config": _stop_after_building,
    "engine.benchmarks.device_throughput.benchmark": _stop_before_measuring,
    "engine.benchmarks.attainment.cli": _stop_before_the_runs,
}


class _ThenStop(importlib.abc.Loader):
    """A module's own loader, then its stop."""

    def __init__(self, loader: importlib.abc.Loader, stop: Callable[[ModuleType], None]) -> None:
        self._loader, self._stop = loader, stop

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._stop(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ...: the module's own loader answers (tracebacks read them).
        return getattr(self._loader, name)


class _StopsOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        stop = STOPS.get(fullname)
        if stop is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ThenStop(spec.loader, stop)
        return spec


def install() -> None:
    """Apply STOPS in this process: to a module already imported now, to the others as they are
    imported."""
    os.environ[DRY_RUN_ENV] = "1"
    for name, stop in STOPS.items():
        if name in sys.modules:
            stop(sys.modules[name])
    sys.meta_path.insert(0, _StopsOnImport())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(USAGE, file=sys.stderr)
        return 2
    module, args = argv[0], argv[1:]
    install()
    sys.argv = [module, *args]
    # As `python -m MODULE`: its `if __name__ == "__main__"` runs, sys.argv[0] is its file.
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
