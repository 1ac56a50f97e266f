"""No module under tests/ imports a test module (`tests/**/test_*.py`): what tests share lives in
tests/utils/ (helpers) or in a folder's conftest.py (fixtures), so that moving or deleting one test
file never breaks another.  Every import counts, including the ones inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def imported_test_modules(source: str, module: str) -> list[str]:
    """The test modules that ``source`` (the text of module ``module``, dotted) imports."""
    package = module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if _is_test_module(base):
                found.append(base)
            found += [f"{base}.{alias.name}" for alias in node.names
                      if _is_test_module(f"{base}.{alias.name}")]
    return found



def test_no_module_under_tests_imports_a_test_module() -> None:
    # Probe: the scanner finds each way of importing one, deferred and relative ones included.
    probe = ("import tests.core.test_scheduler\n"
             "from tests.core.test_scheduler import FakeRunner\n"
             "from tests.core import test_scheduler\n"
             "from .test_slack_policy import FakeScheduler\n"
             "from tests.utils.scheduling import FakeRunner\n"
             "def f():\n    from tests.preemption.test_suspend import x\n")
    assert imported_test_modules(probe, "tests.core.test_probe") == [
        "tests.core.test_scheduler", "tests.core.test_scheduler", "tests.core.test_scheduler",
        "tests.core.test_slack_policy", "tests.preemption.test_suspend"]

    modules = sorted(TESTS.rglob("*.py"))
    assert len([p for p in modules if p.name.startswith("test_")]) > 100  # probe: all found
    offenders = []
    for path in modules:
        module = ".".join(path.relative_to(TESTS.parent).with_suffix("").parts)
        offenders += [f"{module} imports {name}"
                      for name in imported_test_modules(path.read_text(), module)]
    assert not offenders, ("test modules imported (move what they share to tests/utils/ or a "
                           "conftest.py):\n" + "\n".join(offenders))
