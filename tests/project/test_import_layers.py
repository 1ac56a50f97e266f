"""The direction of imports between the project's packages: every module imports only its own
layer and the layers below it, the engine reaches the workers only through its executor package,
and no product package imports the benchmarks or the tests.

The layers, bottom to top (docs/architecture.md, "Layers"):

0. ``kernels`` and ``monitor``: attention kernels; deadlines, the predictor and the preempt signal.
1. The engine's shared base: its configuration, the step messages and the structs both sides
   read (``engine.core``, ``engine.worker_messages``, ...), which the workers need and which
   import nothing above them.
2. ``workers``: the model, the model runner, the worker ranks.
3. The engine: EngineCore, its executors (``engine.executor``, the one package of the engine
   that imports ``workers``), the simulation, the IPC and the front end's request processing.
4. How users reach it: ``engine.entrypoints``, ``engine.serving``, the benchmark library behind
   ``sloserve bench`` (``engine.benchmarks``), and the ``engine`` package itself (its
   ``__init__`` exports ``LLM``).

``bench`` sits above them all and is not checked here, but no product module imports it: the GPU
suite, its dry run and the kernel benchmark live there, and the product knows nothing of them.
"""

from __future__ import annotations

import ast
import re

from tests.utils.import_graph import REPO, _imported_names, _module_files, import_graph

# Each layer: module names, a name standing for itself and everything under it; a module belongs
# to the layer of its longest matching name.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("kernels", "monitor"),
    ("engine.config", "engine.device", "engine.log", "engine.logprobs",
     "engine.outputs", "engine.sampling_params", "engine.core", "engine.worker_messages",
     "engine.model_folder",
     # Each rank's torch threads: the workers set them, the API server and the executors put
     # the wait policy into the environment of the processes they spawn; imports nothing.
     "engine.compute_threads",
     # A free TCP port (the executors' rendezvous, a fleet's proxy, the benchmarks' servers):
     # imports nothing of the project.
     "engine.ports",
     # build_engine_config parses a --chat-template where the configuration is built, and
     # startup calibration reads an environment variable with the command line's value types:
     # both import nothing of the project.
     "engine.processing.chat_template", "engine.entrypoints.arg_types",
     # What a fleet replica reports and the router reads (msgspec structs, the prefix hashes):
     # EngineCore builds the report, so it sits with the other structs both sides read.
     "engine.load.load_report", "engine.load.prefix_hashes",
     # A request's structured-output spec, its grammar state and the step's bitmask: the
     # sampling parameters, the request and the step carry them.
     "engine.structured_output.params", "engine.structured_output.matcher",
     "engine.structured_output.bitmask"),
    ("workers",),
    ("engine.executor", "engine.runtime", "engine.simulation", "engine.ipc",
     "engine.processing", "engine.structured_output",
     # A request's predicted TTFT on a server's load report and the arrivals it forecasts:
     # what one server's admission and a fleet's router both read.
     "engine.load"),
    ("engine", "engine.entrypoints", "engine.serving", "engine.benchmarks", "engine.__main__"),
)
LAYER_NAMES = ("kernels and monitor", "engine base", "workers", "engine", "entrypoints")
# The only engine package that imports workers.
EXECUTOR = "engine.executor"
PRODUCT = ("engine", "workers", "monitor", "kernels")


def _within(module: str, name: str) -> bool:
    return module == name or module.startswith(name + ".")


def layer_of(module: str) -> int | None:
    """The layer of ``module`` (None: bench, which is above every layer)."""
    best: tuple[int, int] | None = None  # (length of the matching name, layer)
    for index, names in enumerate(LAYERS):
        for name in names:
            if _within(module, name) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        here = layer_of(module)
        if here is None:
            continue
        for target in sorted(imported):
            there = layer_of(target)
            if there is not None and there > here:
                found.append(f"{module} ({LAYER_NAMES[here]}) imports {target} "
                             f"({LAYER_NAMES[there]})")
    return found


def test_every_product_module_has_a_layer() -> None:
    modules = [m for m in _module_files() if m.split(".")[0] in PRODUCT]
    assert modules and all(layer_of(m) is not None for m in modules)
    # Probes: the longest name decides.
    assert layer_of("engine.core.scheduler") == 1
    assert layer_of("engine.runtime.engine_core") == 3
    assert layer_of("engine.entrypoints.cli") == 4
    assert layer_of("engine.entrypoints.arg_types") == 1
    assert layer_of("engine.load.load_report") == 1 and layer_of("engine.load.prediction") == 3
    assert layer_of("bench.e2e.throughput") is None


def test_the_check_reports_an_upward_import() -> None:
    graph = {"workers.worker": {"engine.runtime.engine_core"}, "engine.core.request": set()}
    assert upward_imports(graph) == ["workers.worker (workers) imports "
                                     "engine.runtime.engine_core (engine)"]


def test_imports_point_down_the_layers() -> None:
    found = upward_imports(import_graph())
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_only_the_executor_package_imports_workers() -> None:
    graph = import_graph()
    found = [f"{module} imports {target}" for module, imported in sorted(graph.items())
             if _within(module, "engine") and not _within(module, EXECUTOR)
             # The benchmark library measures the workers' layers as the runner runs them (the
             # roofline times the linear layers); it is no path of the engine's.
             and not _within(module, "engine.benchmarks")
             for target in sorted(imported) if _within(target, "workers")]
    assert not found, "engine modules outside engine.executor that import workers:\n" + \
        "\n".join(found)
    # Probe: the executors do.
    assert "workers.worker" in graph["engine.executor.multiproc"]


def test_the_serving_layer_does_not_import_the_fleet() -> None:
    """A fleet wraps the single server's app (its replicas run it, its ingress reuses its
    request reading): the server knows nothing of the fleet. What both read of a server's load
    lives below them (engine.load)."""
    graph = import_graph()
    found = [f"{module} imports {target}" for module, imported in sorted(graph.items())
             if _within(module, "engine.serving")
             for target in sorted(imported) if _within(target, "engine.fleet")]
    assert not found, "engine.serving modules that import engine.fleet:\n" + "\n".join(found)
    # Probes: the fleet does import the server, and the server reads engine.load.
    assert any(_within(t, "engine.serving") for t in graph["engine.fleet.ingress"])
    assert any(_within(t, "engine.load") for t in graph["engine.serving.doomed"])


def bench_or_tests_imports(sources: dict[str, str]) -> list[str]:
    """``module imports name`` for each import of bench or tests in ``sources`` (module name ->
    its source), deferred imports included."""
    modules = _module_files()
    found = []
    for module, source in sorted(sources.items()):
        tree = ast.parse(source, module)
        for name in sorted(_imported_names(tree, module, False, modules)):
            if name.split(".")[0] in ("bench", "tests"):
                found.append(f"{module} imports {name}")
    return found


def test_no_product_module_imports_bench_or_tests() -> None:
    sources = {module: path.read_text() for module, path in _module_files().items()
               if module.split(".")[0] in PRODUCT}
    found = bench_or_tests_imports(sources)
    assert not found, "product modules that import bench or tests:\n" + "\n".join(found)
    # Probe: the check sees such an import, deferred inside a function too.
    assert bench_or_tests_imports({"engine.x": "def f():\n    from bench.e2e import soak\n"}) == [
        "engine.x imports bench.e2e.soak"]
    assert (REPO / "bench").is_dir()


def dry_run_mentions(sources: dict[str, str]) -> list[str]:
    """``module: line`` for each line of ``sources`` (module name -> its source) that names the
    GPU suite's dry run: its module, its switch or its stops."""
    pattern = re.compile(r"dry[_ ]run|DRY_RUN", flags=re.IGNORECASE)
    return [f"{module}: {line.strip()}" for module, source in sorted(sources.items())
            for line in source.splitlines() if pattern.search(line)]


def test_no_product_module_knows_the_suites_dry_run() -> None:
    """The GPU suite's dry run (bench/suite/dry_run.py) stops each step from outside, through its
    launcher: no product module imports it (the test above), reads its switch, calls its stops
    or steps aside for it."""
    sources = {module: path.read_text() for module, path in _module_files().items()
               if module.split(".")[0] in PRODUCT}
    found = dry_run_mentions(sources)
    assert not found, "product modules that know of the dry run:\n" + "\n".join(found)
    # Probes: the check sees each way of naming it, and the dry run lives in bench.
    assert dry_run_mentions({"engine.x": "from bench.suite import dry_run\n",
                             "engine.y": "os.environ.get('SLOSERVE_DRY_RUN')\n",
                             "engine.z": "# under the suite's dry run\n"}) == [
        "engine.x: from bench.suite import dry_run",
        "engine.y: os.environ.get('SLOSERVE_DRY_RUN')", "engine.z: # under the suite's dry run"]
    assert "bench.suite.dry_run" in _module_files()
