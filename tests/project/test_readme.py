"""The README is a user's first contact: every command it (and CONTRIBUTING.md) shows runs as
written (checked through each command's argument parser, or its ``--help`` where it is a
separate script), every file it links exists, and no project file points outside the
repository."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PROGRAMS = ("sloserve", "python", "torchrun")


def readme_commands(text: str, inline: bool = True) -> list[list[str]]:
    """The commands of the README's ```bash blocks and of its inline `python ...` /
    `sloserve ...` / `torchrun ...` spans, as argument lists (comments, line continuations and
    ``&&`` handled; ``pip``, ``curl`` and the test command are not ours to check)."""
    lines: list[str] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines.extend(block.replace("\\\n", " ").splitlines())
    if inline:
        lines.extend(re.findall(r"(?<!`)`((?:%s) [^`]+)`" % "|".join(PROGRAMS), text))
    commands: list[list[str]] = []
    for line in lines:
        for part in line.split("&&"):
            argv = shlex.split(part, comments=True)
            if argv and argv[0] in PROGRAMS and argv[:3] != ["python", "-m", "pytest"]:
                commands.append(argv)
    return commands


# CONTRIBUTING.md's inline spans include placeholders (`python bench/name.py`): its blocks only.
COMMANDS = (readme_commands(README.read_text())
            + readme_commands((REPO / "CONTRIBUTING.md").read_text(), inline=False))


def test_the_readme_shows_the_commands_a_user_runs() -> None:
    # Probe of the extraction: the set-up command, a torchrun line, a bench command and a bench
    # script run as a file.
    shown = {" ".join(argv[:3]) for argv in COMMANDS}
    assert "sloserve serve" in shown
    assert "sloserve bench throughput" in shown
    assert any(argv[0] == "torchrun" and "--rdzv-endpoint" in argv for argv in COMMANDS)
    assert "python bench/e2e/throughput.py" in shown
    assert "python -m bench.kernels.gpu_kernels" in shown


def _sloserve_argv(argv: list[str]) -> list[str] | None:
    """The `sloserve` arguments of a command that runs the engine's CLI, else None."""
    if argv[0] == "sloserve":
        return argv[1:]
    if argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])  # its own flags must be torchrun's
        assert args.module and args.training_script == "engine", argv
        return args.training_script_args
    if argv[:3] == ["python", "-m", "engine"]:
        return argv[3:]
    return None


@pytest.mark.parametrize("argv", [a for a in COMMANDS if _sloserve_argv(a) is not None],
                         ids=lambda argv: " ".join(argv)[:70])
def test_engine_command_parses(argv: list[str]) -> None:
    from engine.entrypoints.cli import build_parser

    args = _sloserve_argv(argv)
    try:
        build_parser().parse_args(args)
    except SystemExit as exc:  # --help, or argparse's error (exit code 2, message on stderr)
        assert exc.code == 0, f"argparse rejected {args}"


def test_scripts_run_as_written() -> None:
    """Every other command, and the entry points themselves, started as a user would: a bench
    script run as a file sees bench/ first on sys.path, where a module named like one of the
    project's packages would shadow it."""
    scripts = {tuple(argv[:3] if argv[1] == "-m" else argv[:2])
               for argv in COMMANDS if _sloserve_argv(argv) is None}
    scripts |= {("sloserve", "serve"), ("python", "-m", "engine")}
    assert ("python", "bench/e2e/preempt_latency.py") in scripts

    def run(prefix: tuple[str, ...]) -> tuple[tuple[str, ...], subprocess.CompletedProcess]:
        argv = [sys.executable if prefix[0] == "python" else prefix[0], *prefix[1:], "--help"]
        return prefix, subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                                      timeout=180)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, sorted(scripts)))
    failed = [f"{' '.join(prefix)} --help: exit {r.returncode}\n{r.stderr[-2000:]}"
              for prefix, r in results if r.returncode != 0 or "usage:" not in r.stdout]
    assert not failed, "\n\n".join(failed)


def test_readme_links_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert "docs/design.md" in local
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_no_file_points_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    pattern = re.compile(r"\.\./shared|(?<![\w/])DESIGN\.md")
    offenders = [name for name in tracked
                 if Path(name).suffix in (".py", ".md", ".toml", ".txt", ".cfg", "")
                 and name != "tests/project/test_readme.py"
                 and pattern.search((REPO / name).read_text(errors="replace"))]
    assert not offenders, f"files that refer to the team's shared folder: {offenders}"


def test_the_request_fields_table_names_every_field_the_server_refuses_or_ignores() -> None:
    from engine.serving.request_fields import (MESSAGE_NOT_IMPLEMENTED, NOT_IMPLEMENTED,
                                               WITHOUT_EFFECT)

    text = README.read_text()
    table = text[text.index("| field | here |"):]
    table = table[:table.index("\n\n")]
    named = set(re.findall(r"`([a-z_]+)`", table))
    missing = (set(NOT_IMPLEMENTED) | set(WITHOUT_EFFECT) | set(MESSAGE_NOT_IMPLEMENTED)) - named
    assert not missing, f"README's request fields table leaves out {sorted(missing)}"
