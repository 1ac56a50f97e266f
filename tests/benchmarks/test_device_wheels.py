"""tools/device_wheels.py without the network: the closure walk (markers for the target's
Python, extras, the image as a boundary, what is never carried), the image list, the on-device
check, and the requirements printed for a CUDA user. tests/benchmarks/test_device_wheels_closure.py runs
the real resolution and proves it in a fresh virtual environment."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from tools.device_wheels import (GPU_IMAGE, CLOSURE_FILE, Dist, ResolutionGap, Target,
                                 canonical, main, never_carried, read_image, requirement_name,
                                 verify, walk)

PY311 = Target("3.11.7", "cp311", ("manylinux_2_28_x86_64",))


def _dists(*dists: Dist) -> dict[str, Dist]:
    return {canonical(d.name): d for d in dists}


def test_the_image_list_is_read_with_its_known_versions() -> None:
    image = read_image()
    # Probes of the parsing: a pinned entry, a bare one, and names normalized per PEP 503.
    assert image["transformers"] == "5.17.0" and image["torch"] == "2.11.0"
    assert "anyio" in image and image["anyio"] is None
    assert "typing-extensions" in image and "huggingface-hub" in image
    assert len(image) > 150
    # What the serving stack needs and the image lacks must not be listed as present.
    assert not {"fastapi", "uvicorn", "msgspec", "starlette", "opentelemetry-api"} & set(image)


def test_markers_are_evaluated_for_the_target_python_not_the_one_running_pip() -> None:
    resolved = _dists(Dist("app", "1.0", ('backport>=1; python_version < "3.12"',
                                          'modern; python_version >= "3.12"')),
                      Dist("backport", "1.2", ()), Dist("modern", "2.0", ()))
    assert walk(["app"], resolved, {}, GPU_IMAGE).carried == {"app": "1.0", "modern": "2.0"}
    assert walk(["app"], resolved, {}, PY311).carried == {"app": "1.0", "backport": "1.2"}


def test_extras_pull_their_requirements_only_when_asked_for() -> None:
    resolved = _dists(Dist("uvicorn", "0.54.0", ("h11>=0.8", 'httptools>=0.8; extra == "standard"')),
                      Dist("h11", "0.16.0", ()), Dist("httptools", "0.9.0", ()))
    assert set(walk(["uvicorn"], resolved, {}, GPU_IMAGE).carried) == {"uvicorn", "h11"}
    assert set(walk(["uvicorn[standard]"], resolved, {}, GPU_IMAGE).carried) == {
        "uvicorn", "h11", "httptools"}


def test_the_walk_stops_at_the_image_and_records_what_is_asked_of_it() -> None:
    resolved = _dists(Dist("starlette", "1.10.0", ("anyio<5,>=4.0.0", "Typing_Extensions>=4.10")),
                      Dist("anyio", "4.16.0", ("idna>=2.8",)), Dist("idna", "3.20", ()))
    image = {"anyio": None, "typing-extensions": "4.15.0"}
    closure = walk(["starlette"], resolved, image, GPU_IMAGE)
    assert closure.carried == {"starlette": "1.10.0"}  # not anyio, nor anyio's idna
    assert closure.from_image == {"anyio": {"starlette": "<5,>=4.0.0"},
                                  "typing-extensions": {"starlette": ">=4.10"}}


def test_a_known_image_version_out_of_range_is_an_error_naming_both() -> None:
    resolved = _dists(Dist("app", "1.0", ("transformers>=6",)))
    with pytest.raises(SystemExit, match=r"app requires transformers>=6, the image has "
                                         r"transformers 5\.17\.0"):
        walk(["app"], resolved, {"transformers": "5.17.0"}, GPU_IMAGE)


def test_a_package_pip_left_out_is_reported_for_another_round() -> None:
    resolved = _dists(Dist("app", "1.0", ('backport>=1; python_version < "3.12"',
                                          'uvicorn[standard]; python_version < "3.12"')))
    with pytest.raises(ResolutionGap) as gap:
        walk(["app"], resolved, {}, PY311)
    assert gap.value.requirements == ["backport>=1", "uvicorn[standard]"]


def test_torch_triton_and_cuda_libraries_are_never_carried() -> None:
    assert never_carried("torch") and never_carried("Triton")
    assert never_carried("nvidia_cublas") and not never_carried("fastapi")
    resolved = _dists(Dist("app", "1.0", ("nvidia-cudnn-cu99",)),
                      Dist("nvidia-cudnn-cu99", "9.0", ()))
    with pytest.raises(SystemExit, match="nvidia-cudnn-cu99.*GPU image must provide"):
        walk(["app"], resolved, {}, GPU_IMAGE)


def test_a_wheel_for_another_python_is_refused() -> None:
    resolved = _dists(Dist("app", "1.0", (), requires_python=">=3.13"))
    with pytest.raises(SystemExit, match=r"app 1\.0, which requires Python >=3\.13"):
        walk(["app"], resolved, {}, GPU_IMAGE)


def _closure_dir(tmp_path: Path, carried: dict, from_image: dict) -> Path:
    (tmp_path / CLOSURE_FILE).write_text(json.dumps(
        {"python": "3.12.3", "abi": "cp312", "carried": carried, "from_image": from_image}))
    return tmp_path


def test_verify_passes_where_the_pins_are_what_is_imported(tmp_path: Path, capsys) -> None:
    dest = _closure_dir(tmp_path, {"msgspec": version("msgspec")},
                        {"numpy": {"gguf": ">=1.17"}})
    assert verify(dest) == []
    assert main(["--verify", "--dest", str(dest)]) == 0
    assert "1 carried packages imported as pinned" in capsys.readouterr().out


def test_verify_names_each_problem_and_its_fix(tmp_path: Path) -> None:
    dest = _closure_dir(tmp_path, {"msgspec": "0.0.1", "not-a-real-package-xyz": "1.0"},
                        {"numpy": {"gguf": ">=999"}, "absent-image-package-xyz": {"app": ""}})
    problems = "\n".join(verify(dest))
    assert f"msgspec: carried 0.0.1, imported {version('msgspec')}" in problems
    assert "not-a-real-package-xyz: carried 1.0, imported nothing" in problems
    assert "gguf requires numpy>=999" in problems and "--also 'numpy>=999'" in problems
    assert "absent-image-package-xyz" in problems and "--also absent-image-package-xyz" in problems
    assert main(["--verify", "--dest", str(dest)]) == 1


def test_requirements_for_a_cuda_user_leave_torch_and_triton_out(capsys) -> None:
    assert main(["--requirements"]) == 0
    printed = capsys.readouterr().out.split()
    assert "fastapi" in printed and "uvicorn[standard]" in printed
    assert not [r for r in printed if requirement_name(r) in ("torch", "triton")]
    assert "hypothesis>=6.100" not in printed  # the test extra only when asked for
    assert main(["--requirements", "--extras", "test"]) == 0
    assert "hypothesis>=6.100" in capsys.readouterr().out.split()
    assert requirement_name("Typing_Extensions>=4; python_version<'3.13'") == "typing-extensions"


def test_resolution_retries_a_gap_and_carries_what_also_names(monkeypatch) -> None:
    """pip (on the host's Python) leaves out `backport`, which the target needs: asked again
    with it. `--also anyio>=4.5` carries anyio although the image has one."""
    import tools.device_wheels as dw

    asked: list[list[str]] = []
    universe = _dists(Dist("fastapi", "0.165.0", ("anyio>=4", 'backport; python_version < "3.12"')),
                      Dist("anyio", "4.16.0", ()), Dist("backport", "1.0", ()))

    def fake_resolve(requirements, target, image):
        asked.append(list(requirements))
        names = {canonical(r.split(">")[0].split("=")[0]) for r in requirements}
        return {n: d for n, d in universe.items() if n in names}

    monkeypatch.setattr(dw, "pip_resolve", fake_resolve)
    monkeypatch.setattr(dw, "project_requirements", lambda extras: ["torch==2.13.0", "fastapi"])
    assert dw.serving_roots(("test",), ()) == ["fastapi"]
    closure = dw.resolve_closure(PY311, also=("anyio>=4.5",), image={"anyio": None, "torch": None})
    assert closure.carried == {"fastapi": "0.165.0", "anyio": "4.16.0", "backport": "1.0"}
    assert asked == [["fastapi", "anyio>=4.5"], ["fastapi", "anyio>=4.5", "backport"]]
