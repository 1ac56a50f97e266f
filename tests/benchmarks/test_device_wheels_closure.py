"""The wheel recipe for air-gapped GPU machines, resolved for real (PyPI, through pip as this
machine is set up) and proved:

- `python -m tools.device_wheels` downloads the closure for the GPU image's Python 3.12, which
  carries what the serving stack needs beyond the image's package list and never torch;
- every third-party module the serving packages import comes from the image or the closure;
- in a fresh virtual environment holding only the image's packages that the closure counts on
  (plus this machine's CPU torch) and the closure's wheels, installed as a device call installs
  them, the API server imports, `python -m engine serve --help` runs, `pip check` is clean and
  `--verify` passes. The same resolution is made for this machine's Python (the GPU image's
  3.12 wheels cannot install here); the environment is cached under the sloserve cache folder,
  keyed on what it holds."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from tools.device_wheels import (CLOSURE_FILE, canonical, download, host_target, never_carried,
                                 read_image, resolve_closure)
from engine.entrypoints.default_model import cache_dir

REPO = Path(__file__).resolve().parents[2]
SERVING_PACKAGES = ("engine", "workers", "monitor", "kernels")


@pytest.fixture(scope="module")
def gpu_wheels(tmp_path_factory) -> Path:
    """The recipe as a user runs it, into a scratch folder: the wheels and closure.json."""
    dest = tmp_path_factory.mktemp("gpu-wheels")
    proc = subprocess.run([sys.executable, "-m", "tools.device_wheels", "--dest", str(dest)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"python -m tools.device_wheels failed:\n{proc.stderr[-3000:]}"
    return dest


def test_the_gpu_closure_carries_what_the_image_lacks(gpu_wheels: Path) -> None:
    closure = json.loads((gpu_wheels / CLOSURE_FILE).read_text())
    carried, image = closure["carried"], read_image()
    assert closure["python"] == "3.12.3" and closure["abi"] == "cp312"
    # fastapi imports opentelemetry (the hand-kept list missed it), and starlette, pydantic.
    assert {"fastapi", "starlette", "pydantic", "pydantic-core", "opentelemetry-api", "uvicorn",
            "msgspec", "gguf"} <= set(carried)
    assert not set(carried) & set(image), "carried a package the image has"
    assert not [n for n in carried if never_carried(n)]
    # What the closure asks of the image is recorded for --verify (anyio for starlette).
    assert "starlette" in closure["from_image"]["anyio"]
    wheels = sorted(gpu_wheels.glob("*.whl"))
    assert sorted(canonical(w.name.split("-")[0]) for w in wheels) == sorted(carried)
    for wheel in wheels:  # {python tag}-{abi tag}-{platform tag}: loadable by CPython 3.12
        py, abi, plat = wheel.name[:-4].split("-")[-3:]
        assert plat == "any" or "x86_64" in plat and "manylinux" in plat, wheel.name
        assert abi in ("none", "abi3", "cp312"), wheel.name


def _third_party_imports() -> dict[str, set[str]]:
    """{top-level module: files importing it} over the serving packages, stdlib and the
    project's own packages left out. Imports inside functions count: they run when served."""
    found: dict[str, set[str]] = {}
    for package in SERVING_PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in (*SERVING_PACKAGES,
                                                                          "bench", "tests"):
                        found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _cluster_extra() -> set[str]:
    """The distributions of the `cluster` extra (Ray Serve): a fleet's, which the GPU suite's
    single-engine runs never import and whose wheels are not carried."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {canonical(Requirement(r).name)
            for r in project["optional-dependencies"]["cluster"]}


def test_every_serving_import_comes_from_the_image_or_the_closure(gpu_wheels: Path) -> None:
    imports = _third_party_imports()
    cluster = _cluster_extra()
    assert cluster == {"ray"}  # probe
    assert {"torch", "fastapi", "msgspec", "starlette", "transformers"} <= set(imports)  # probe
    provided = set(read_image()) | set(json.loads((gpu_wheels / CLOSURE_FILE).read_text())
                                       ["carried"])
    dists = packages_distributions()
    unmapped = sorted(m for m in imports if m not in dists)
    assert not unmapped, f"modules not installed here, so not mapped to a package: {unmapped}"
    missing = {m: sorted(imports[m]) for m in imports
               if not {canonical(d) for d in dists[m]} & (provided | cluster)}
    assert not missing, f"imported, but neither in the GPU image nor carried: {missing}"


def _run(argv: list[str], env: dict[str, str], what: str) -> str:
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n" \
        f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _installable(name: str, version: str | None, env: dict[str, str]) -> bool:
    """Whether the image's version of `name` has a wheel for this Python (numpy 2.5 needs
    3.12): where it has none, the venv takes the latest that installs."""
    if version is None:
        return False
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run",
                           "--ignore-installed", "--no-deps", "--only-binary=:all:",
                           f"{name}=={version}"], env=env, capture_output=True).returncode == 0


def _image_venv(from_image: dict[str, dict[str, str]], env: dict[str, str]) -> Path:
    """A venv (no system site-packages) holding what the closure counts on the image for: those
    packages at the image's versions where known, this machine's CPU torch in place of the
    image's CUDA one, and transformers. Cached, keyed on exactly that."""
    import torch

    if "+cpu" not in torch.__version__:
        pytest.skip(f"installs this machine's CPU torch by its exact version; {torch.__version__}"
                    " is not a CPU build, and a plain pin could pull a CUDA one")
    image = read_image()
    # torch is this machine's CPU build (below); triton, which the image's CUDA torch brings,
    # is installed as the image lists it where a carried package counts on it (xgrammar).
    names = {"transformers"} | {n for n in from_image
                                if not never_carried(n) or canonical(n) == "triton"}
    wanted = sorted({f"torch=={torch.__version__}"}
                    | {f"{n}=={image[n]}" if _installable(n, image[n], env) else n
                       for n in names})
    key = hashlib.sha256(json.dumps([sys.version, wanted]).encode()).hexdigest()[:16]
    venv = cache_dir() / "device-wheels" / f"image-venv-{key}"
    if (venv / "complete").exists():
        return venv
    scratch = venv.with_name(venv.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(scratch)], env, "python -m venv")
    _run([str(scratch / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:",
          *wanted], env, "installing the image's packages into the fresh venv")
    # Only the image list's packages: one from elsewhere (typer's pydantic, python-dateutil's
    # tzdata: the image's own needs, which its list does not name) could hide a hole in the
    # closure. The image's own requirements are not this test's (see _closure_problems).
    listed = json.loads(_run([str(scratch / "bin" / "python"), "-m", "pip", "list",
                              "--format", "json"], env, "pip list"))
    foreign = sorted(d["name"] for d in listed if canonical(d["name"]) not in image)
    if foreign:
        _run([str(scratch / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *foreign],
             env, "removing what the image list does not name")
    (scratch / "complete").write_text("\n".join(wanted) + "\n")
    shutil.rmtree(venv, ignore_errors=True)
    scratch.rename(venv)  # `bin/python -m ...` finds its venv wherever the folder lies
    return venv


def _closure_problems(python: str, env: dict[str, str], carried: set[str]) -> str:
    """`pip check`'s complaints about the carried packages (the image's own packages may need
    things the image list does not name, which the venv leaves out)."""
    proc = subprocess.run([python, "-m", "pip", "check"], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 or lines, f"pip check failed:\n{proc.stderr[-2000:]}"
    return "\n".join(line for line in lines if canonical(line.split()[0]) in carried)


def test_the_closure_serves_in_a_fresh_venv(gpu_wheels: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    # This Python's wheels for the same packages; the GPU image's versions are 3.12's, so
    # the image counts here by name alone.
    closure = resolve_closure(host_target(), image=dict.fromkeys(read_image()))
    gpu_carried = json.loads((gpu_wheels / CLOSURE_FILE).read_text())["carried"]
    assert set(closure.carried) == set(gpu_carried), \
        "the closure for this Python is not the GPU image's, so this test no longer proves it"
    python = str(_image_venv(closure.from_image, env) / "bin" / "python")
    wheels = tmp_path / "whl"
    download(closure, host_target(), wheels)
    # As a device call installs them: beside the image's packages, first on the path.
    _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
          "--target", str(tmp_path / "site"), *map(str, wheels.glob("*.whl"))], env,
         "installing the closure's wheels")
    env["PYTHONPATH"] = f"{tmp_path / 'site'}:{REPO}"
    probe = _run([python, "-c", "import fastapi, engine.serving.api_server, sys; "
                  "print(fastapi.__file__, sys.prefix)"], env, "import engine.serving.api_server")
    assert str(tmp_path / "site") in probe and str(python).rsplit("/bin/", 1)[0] in probe
    assert "usage:" in _run([python, "-m", "engine", "serve", "--help"], env,
                            "python -m engine serve --help")
    problems = _closure_problems(python, env, set(closure.carried))
    assert not problems, "the carried packages' requirements are not all met:\n" + problems
    assert "in range" in _run([python, "-m", "tools.device_wheels", "--verify", "--dest",
                               str(wheels)], env, "python -m tools.device_wheels --verify")
