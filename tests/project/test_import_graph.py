"""The project's modules import each other without cycles, and no script in bench/ shadows a
package when it is run as a file.

Every import counts, including the ones inside functions and under ``TYPE_CHECKING``: a cycle
that is only broken by deferring an import still ties the two modules' designs together, and
a reader following imports downward never meets it.
"""

from __future__ import annotations

from tests.utils.import_graph import REPO, cycles, import_graph


def test_the_graph_sees_the_imports_it_must() -> None:
    # Probe: the scanner finds deferred, TYPE_CHECKING and importlib imports, or the cycle test
    # below would pass on a graph with no edges.
    graph = import_graph()
    assert "engine.core.scheduler" in graph["engine.runtime.engine_core"]
    assert "kernels.triton_attention" in graph["kernels.backend"]  # importlib.import_module
    assert "workers.model_runner" in graph["engine.executor.in_process"]  # under TYPE_CHECKING
    assert sum(len(edges) for edges in graph.values()) > 200


def test_cycle_detection_reports_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles among the project's modules:\n" + "\n".join(
        " <-> ".join(component) for component in found)


def test_no_bench_script_shadows_a_package() -> None:
    # `python bench/e2e/x.py` puts bench/e2e/ first on sys.path: a module or folder there named
    # like one of the project's packages (bench/kernels/ beside a script in bench/) would hide it.
    top_level = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    script_folders = {p.parent for p in (REPO / "bench").rglob("*.py")
                      if "__name__ == \"__main__\"" in p.read_text()}
    assert REPO / "bench" / "e2e" in script_folders  # the probe: scripts are found
    shadowing = sorted(f"{folder.relative_to(REPO)}/{p.name}" for folder in script_folders
                       for p in folder.iterdir() if p.name.removesuffix(".py") in top_level)
    assert not shadowing, f"names in bench/ script folders that hide packages: {shadowing}"
