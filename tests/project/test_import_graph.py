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
    # `python bench/x.py` puts bench/ first on sys.path: a bench/kernels.py would hide kernels/.
    top_level = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    shadowing = sorted(p.stem for p in (REPO / "bench").glob("*.py") if p.stem in top_level)
    assert not shadowing, f"bench/ modules named like the project's packages: {shadowing}"
