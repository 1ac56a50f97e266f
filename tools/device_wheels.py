"""The wheels an air-gapped GPU machine lacks to run this project, resolved rather than hand-kept.

    python -m tools.device_wheels              # resolve and download them into .whl/
    python -m tools.device_wheels --verify     # on the GPU machine, after installing them

The GPU machines' image ('cuda', Python 3.12, manylinux x86_64) has torch, triton, transformers
and about two hundred other packages (tools/device_image_packages.txt) but not the serving
stack (fastapi, uvicorn, msgspec, ...), and nothing can be fetched there. This module resolves
the project's dependencies (pyproject.toml, with the `test` extra: the GPU suite runs pytest)
for that interpreter with pip's resolver, walks the result from the project's requirements with
the markers evaluated for the image's Python (pip evaluates them for the Python running it),
stops at every package the image has, and downloads exactly the rest. torch, triton and the
nvidia-* packages are never carried: the image's CUDA builds must stay the ones imported.

A device call carries .whl and starts with:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \\
        && python3 -m tools.device_wheels --verify || exit

The image's packages whose versions nobody has read (a bare name in the list) are trusted to
satisfy what the carried packages ask of them; --verify checks that on the machine and names
any that do not, with the fix (`--also NAME` carries a newer one, which shadows the image's).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IMAGE_PACKAGES = Path(__file__).resolve().with_name("device_image_packages.txt")
CLOSURE_FILE = "closure.json"


def canonical(name: str) -> str:
    """PEP 503's normalized name: `Typing_Extensions` and `typing-extensions` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def never_carried(name: str) -> bool:
    """torch, triton and CUDA's libraries: a carried copy would shadow the image's CUDA build."""
    name = canonical(name)
    return name in ("torch", "triton") or name.startswith("nvidia-")


@dataclass(frozen=True)
class Target:
    """The interpreter the wheels are for: pip's platform flags and the marker environment."""
    python_full_version: str
    abi: str | None            # None: this interpreter, no platform flags given to pip
    platforms: tuple[str, ...] = ()

    @property
    def python_version(self) -> str:
        return ".".join(self.python_full_version.split(".")[:2])

    def pip_flags(self) -> list[str]:
        if self.abi is None:
            return []
        flags = ["--python-version", self.python_version, "--implementation", "cp",
                 "--abi", self.abi]
        for tag in self.platforms:
            flags += ["--platform", tag]
        return flags

    def marker_env(self) -> dict[str, str]:
        if self.abi is None:
            from packaging.markers import default_environment
            return dict(default_environment())
        return {"implementation_name": "cpython", "implementation_version":
                self.python_full_version, "os_name": "posix", "platform_machine": "x86_64",
                "platform_python_implementation": "CPython", "platform_release": "",
                "platform_system": "Linux", "platform_version": "",
                "python_full_version": self.python_full_version,
                "python_version": self.python_version, "sys_platform": "linux"}


# The image's python3 is 3.12.3 on glibc 2.39 (Ubuntu 24.04). pip matches a manylinux_2_N tag
# only when named, so every N the machine can load is listed.
GPU_IMAGE = Target("3.12.3", "cp312", tuple(
    [f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]))


def host_target() -> Target:
    return Target(platform.python_version(), None)


def read_image(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """{canonical name: version, or None where the list does not say}."""
    image: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[canonical(name)] = version.strip() or None
    return image


def _load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: pip carries a copy of the same parser
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(path.read_text())


def project_requirements(extras: tuple[str, ...] = ("test",),
                         pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    project = _load_toml(pyproject)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


@dataclass(frozen=True)
class Dist:
    name: str
    version: str
    requires: tuple[str, ...]
    requires_python: str = ""


@dataclass
class Closure:
    """What must be carried, and what the carried packages and the project ask of the image."""
    carried: dict[str, str] = field(default_factory=dict)   # canonical name -> pinned version
    from_image: dict[str, dict[str, str]] = field(default_factory=dict)
    # canonical name -> {who asks: specifier}, e.g. "anyio": {"starlette": "<5,>=4.0.0"}

    def to_json(self, target: Target) -> dict[str, Any]:
        return {"python": target.python_full_version, "abi": target.abi,
                "carried": dict(sorted(self.carried.items())),
                "from_image": {k: dict(sorted(v.items()))
                               for k, v in sorted(self.from_image.items())}}


class ResolutionGap(Exception):
    """The walk reached a package pip's resolution left out (its markers are false for the
    Python that ran pip but true for the target's)."""

    def __init__(self, requirements: list[str]):
        super().__init__(", ".join(requirements))
        self.requirements = requirements


def walk(roots: list[str], resolved: dict[str, Dist], image: dict[str, str | None],
         target: Target) -> Closure:
    """The closure of `roots` over `resolved`, markers evaluated for `target`, stopping at the
    image's packages. A known image version that a requirement excludes is an error: carrying a
    second transformers or numpy over the image's would change what the GPU tests measure."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    env = target.marker_env()
    closure, gaps, conflicts = Closure(), [], []
    seen: set[tuple[str, frozenset[str]]] = set()
    stack: list[tuple[str, str, frozenset[str]]] = [(r, "pyproject.toml", frozenset({""}))
                                                   for r in roots]
    while stack:
        text, asker, asker_extras = stack.pop()
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({**env, "extra": e})
                                  for e in asker_extras):
            continue
        name = canonical(req.name)
        if name in image:
            asks = closure.from_image.setdefault(name, {})
            specs = [s for s in (asks.get(asker, ""), str(req.specifier)) if s]
            asks[asker] = ",".join(dict.fromkeys(specs))
            known = image[name]
            if known is not None and not req.specifier.contains(known, prereleases=True):
                conflicts.append(f"{asker} requires {req}, the image has {name} {known}")
            continue
        if never_carried(name):
            raise SystemExit(f"{asker} requires {req}, which the GPU image must provide: add it "
                             f"to {IMAGE_PACKAGES.name} if the image has it")
        if name not in resolved:
            extras_text = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            gaps.append(f"{req.name}{extras_text}{req.specifier}")  # the marker was for us
            continue
        dist = resolved[name]
        if not req.specifier.contains(dist.version, prereleases=True):
            raise SystemExit(f"{asker} requires {req}; pip resolved {name} {dist.version}")
        if not SpecifierSet(dist.requires_python).contains(target.python_full_version,
                                                          prereleases=True):
            raise SystemExit(f"pip resolved {name} {dist.version}, which requires Python "
                             f"{dist.requires_python}: not {target.python_full_version}")
        closure.carried[name] = dist.version
        extras = frozenset({""} | {canonical(e) for e in req.extras})
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        stack += [(r, dist.name, extras) for r in dist.requires]
    if conflicts:
        raise SystemExit("the GPU image's versions do not satisfy:\n  " + "\n  ".join(conflicts))
    if gaps:
        raise ResolutionGap(sorted(set(gaps)))
    return closure


def _pip(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip {args[0]} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def pip_resolve(requirements: list[str], target: Target,
                image: dict[str, str | None]) -> dict[str, Dist]:
    """pip's resolution of `requirements` for `target` (nothing installed), the image's known
    versions as constraints so that the carried packages are chosen to work with them.
    pip checks Requires-Python against the Python running it whatever --python-version says,
    so that check is off here and `walk` makes it against the target's."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp, "image-constraints.txt")
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in image.items() if v))
        report = Path(tmp, "report.json")
        _pip("install", "--dry-run", "--ignore-installed", "--ignore-requires-python",
             "--quiet", "--only-binary=:all:",
             "--report", str(report), "--target", str(Path(tmp, "target")),
             "-c", str(constraints), *target.pip_flags(), *requirements)
        installs = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): Dist(
        i["metadata"]["name"], i["metadata"]["version"],
        tuple(i["metadata"].get("requires_dist") or ())) for i in installs}


def requirement_name(text: str) -> str:
    """The canonical name a requirement string starts with (no `packaging` needed: the
    --requirements path runs before anything is installed)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
    if not match:
        raise ValueError(f"not a requirement: {text!r}")
    return canonical(match.group(1))


def serving_roots(extras: tuple[str, ...], also: tuple[str, ...]) -> list[str]:
    """The project's requirements, torch and triton left out (the image's CUDA builds)."""
    roots = [r for r in project_requirements(extras) if not never_carried(requirement_name(r))]
    return roots + list(also)


def resolve_closure(target: Target = GPU_IMAGE, extras: tuple[str, ...] = ("test",),
                    also: tuple[str, ...] = (),
                    image: dict[str, str | None] | None = None) -> Closure:
    """The closure for `target`. `also` names image packages to carry all the same (a newer
    one than the image's, as --verify may ask for)."""
    image = dict(read_image() if image is None else image)
    for req in also:
        image.pop(requirement_name(req), None)
    roots = serving_roots(extras, also)
    # What pip is asked to resolve: the roots the image does not already have.
    ask = [r for r in roots if requirement_name(r) not in image]
    for _ in range(4):
        resolved = pip_resolve(ask, target, image)
        try:
            return walk(roots, resolved, image, target)
        except ResolutionGap as gap:
            ask = ask + [r for r in gap.requirements if r not in ask]
    raise SystemExit(f"pip's resolution kept leaving out packages the walk needs: {ask}")


def download(closure: Closure, target: Target, dest: Path) -> list[Path]:
    """The carried wheels into `dest` (emptied first), one per package."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        old.unlink()
    pins = [f"{n}=={v}" for n, v in sorted(closure.carried.items())]
    if pins:
        _pip("download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(dest),
             *target.pip_flags(), *pins)
    wheels = sorted(dest.glob("*.whl"))
    names = sorted(canonical(w.name.split("-", 1)[0]) for w in wheels)
    if names != sorted(closure.carried):
        raise SystemExit(f"downloaded {names}, expected {sorted(closure.carried)}")
    (dest / CLOSURE_FILE).write_text(json.dumps(closure.to_json(target), indent=1) + "\n")
    return wheels


def verify(dest: Path) -> list[str]:
    """On the machine the wheels were made for, with them on the path: what is wrong, if
    anything (a carried package not the one imported, an image version out of range)."""
    from importlib.metadata import PackageNotFoundError, version
    from packaging.specifiers import SpecifierSet

    data = json.loads((dest / CLOSURE_FILE).read_text())
    problems = []
    for name, pinned in data["carried"].items():
        try:
            found = version(name)
        except PackageNotFoundError:
            found = None
        if found != pinned:
            problems.append(f"{name}: carried {pinned}, imported {found or 'nothing'} (are the "
                            "wheels installed and their folder first on PYTHONPATH?)")
    for name, asks in data["from_image"].items():
        try:
            found = version(name)
        except PackageNotFoundError:
            problems.append(f"{name}: the image list has it, this machine does not: carry it "
                            f"with `python -m tools.device_wheels --also {name}`")
            continue
        for asker, spec in asks.items():
            if not SpecifierSet(spec).contains(found, prereleases=True):
                problems.append(f"{name} {found} here, {asker} requires {name}{spec}: carry "
                                f"one with `python -m tools.device_wheels --also '{name}{spec}'`")
    return problems


def mark_ignored(dest: Path) -> None:
    """Keep the wheels out of git (.git/info/exclude: local, like the wheels themselves)."""
    try:
        rel = dest.resolve().relative_to(REPO)
        exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"],
                                      cwd=REPO, capture_output=True, text=True,
                                      check=True).stdout.strip())
    except (ValueError, subprocess.CalledProcessError, FileNotFoundError):
        return  # outside the repository, or no git: nothing to ignore
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    line = f"/{rel.as_posix()}/"
    if line not in (exclude.read_text().splitlines() if exclude.exists() else []):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write(line + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.device_wheels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl",
                        help="the wheels' folder (default: .whl in the repository, git-ignored)")
    parser.add_argument("--extras", nargs="*", default=None,
                        help="pyproject extras to include (default: test for the wheels, none "
                             "for --requirements)")
    parser.add_argument("--also", nargs="*", default=[], metavar="REQ",
                        help="image packages to carry all the same, e.g. 'anyio>=4.5'")
    parser.add_argument("--verify", action="store_true",
                        help="on the GPU machine: check the carried and image packages")
    parser.add_argument("--requirements", action="store_true",
                        help="print the project's requirements without torch and triton (for "
                             "installing next to a CUDA torch you keep) and exit")
    args = parser.parse_args(argv)
    if args.extras is None:
        args.extras = [] if args.requirements else ["test"]
    if args.requirements:
        print("\n".join(serving_roots(tuple(args.extras), ())))
        return 0
    if args.verify:
        problems = verify(args.dest)
        data = json.loads((args.dest / CLOSURE_FILE).read_text())
        if problems:
            print("device wheels: NOT usable here:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"device wheels: {len(data['carried'])} carried packages imported as pinned, "
              f"{len(data['from_image'])} image packages in range")
        return 0
    closure = resolve_closure(GPU_IMAGE, tuple(args.extras), tuple(args.also))
    mark_ignored(args.dest)
    wheels = download(closure, GPU_IMAGE, args.dest)
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels for Python {GPU_IMAGE.python_version} ({size:.1f} MiB) in "
          f"{args.dest}: " + ", ".join(f"{n}=={v}" for n, v in sorted(closure.carried.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
