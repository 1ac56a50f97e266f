"""The GPU suite (`bash bench/suite/gpu_suite.sh`) on the CPU, so that the two calls a GPU machine
runs cannot rot where CI has no GPU:

- `--dry-run`: every step of both calls with its exact full-size flags (the 8B shape, `--device
  cuda`), each through the dry run's launcher (bench/suite/dry_run.py), up to its engine
  configuration; a probe shows a renamed flag fails it;
- `--core --device cpu --smoke`: the core call end to end at tiny shapes, with one step killed at
  its limit (the summary still comes out, with what the killed step had measured), and the
  suite itself interrupted mid-step;
- `--device cpu --smoke`: the full call end to end (its unchunked HTTP burst aside: the core
  call's, with another budget).

A dry run's step is one Python process importing torch and building a configuration, on one
core, and a smoke step is mostly Python starting (torch, transformers) around a few seconds of
tiny-model compute; CI's machine has two cores. So the two dry runs and the full call's smoke
start in the background when the module starts (`suite_runs`) and go on beside the core call's
smoke runs, which run in the foreground; their tests read what they left. No smoke test checks a
time against anything but its step's limit (four times the H100's, for --smoke).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.utils.figures_wait import wait_for_figures

ROOT = Path(__file__).resolve().parents[2]
# The suite's script, the command CONTRIBUTING documents.
SCRIPT = ROOT / "bench" / "suite" / "gpu_suite.sh"
CORE_STEPS = ["smoke", "throughput", "calibrate", "burst-http-2048", "stream-gaps"]
FULL_STEPS = ["equality", "structured", "tests-cuda", "preempt-latency", "burst-http-unchunked",
              "throughput-hf", "kernels", "tests-triton-compiled", "burst-inprocess"]
# The first H100 run's TTFT line (bench/RESULTS.md, 2026-11-27): what the full call finds in
# OUT when the core call ran before it on the same machine.
H100_TTFT_MODEL = {"seconds_per_token": 2.035e-05, "intercept_s": 0.005338,
                   "seconds_per_token_sq": 1.077e-09, "seconds_per_decode_context": 2.836e-07,
                   "floor_s": 0.008373}
# The pytest steps have no engine: their dry run is a collection.
TEST_STEPS = {"tests-cuda", "tests-triton-compiled"}


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable, "SLOSERVE_STARTUP_CALIBRATION_S": "0.3",
            **extra}


def _steps(out: Path) -> dict[str, list[str]]:
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    return {row[0]: row[1:] for row in rows}


def _last_line(out: Path, step: str) -> str:
    lines = [line for line in (out / f"{step}.log").read_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(args: list[str], timeout: float, script: Path = SCRIPT,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env or _env(),
                          capture_output=True, text=True, timeout=timeout)


class _Background:
    """A suite run started in the background (`suite_runs`), its output in files (no pipe
    fills up while no test reads it)."""

    def __init__(self, folder: Path, args: list[str], script: Path = SCRIPT,
                 env: dict[str, str] | None = None) -> None:
        self.stdout, self.stderr = folder / "suite.stdout", folder / "suite.stderr"
        with self.stdout.open("w") as stdout, self.stderr.open("w") as stderr:
            self.proc = subprocess.Popen(["bash", str(script), *args], cwd=ROOT,
                                         env=env or _env(), stdout=stdout, stderr=stderr)

    def result(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Waits for the run (at most ``timeout`` more seconds: then it is stopped and the test
        fails)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           self.stdout.read_text(), self.stderr.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the suite's trap stops its step and writes the summary
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _start_dry_run(folder: Path) -> _Background:
    return _Background(folder, [str(folder / "dry"), "--dry-run"])


# The dry run's probe: the core call's --enforce-eager commands from a copy of the script with
# one flag misspelt, the calibration's limit cut to a second (no Python with torch starts that
# fast); only the steps those touch (the smoke step has no --enforce-eager of its own: the
# full-size dry run checks its command).
EAGER_PROBE_STEPS = ["throughput", "calibrate", "burst-http-2048", "stream-gaps"]


def _start_eager_dry_run(folder: Path) -> _Background:
    bench = folder / "copy" / "bench" / "suite"
    bench.mkdir(parents=True)
    text = SCRIPT.read_text()
    assert text.count("--eager-batches 1 64") == 1  # the full-size flags
    (bench / "gpu_suite.sh").write_text(text.replace("--eager-batches 1 64",
                                                     "--eager-batch-sizes 1 64"))
    # The copy runs from its own folder; the project comes from ROOT.
    env = _env(PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    only = [arg for name in EAGER_PROBE_STEPS for arg in ("--only", name)]
    return _Background(folder, [str(folder / "dry-eager"), "--dry-run", "--core",
                                "--assume-capture-failed", "--limit", "calibrate=1", *only],
                       script=bench / "gpu_suite.sh", env=env)


# The full call's steps its smoke test runs: all but the unchunked HTTP burst, which is the core
# call's HTTP burst (`burst_http`, run end to end by the core smoke test) with another budget;
# the dry run builds its command at full size. Two more servers would add a quarter of the
# test's time and nothing it checks.
FULL_SMOKE_STEPS = [name for name in FULL_STEPS if name != "burst-http-unchunked"]


def _start_full_smoke(folder: Path) -> _Background:
    out = folder / "full"
    out.mkdir()
    (out / "ttft_model.json").write_text(json.dumps(H100_TTFT_MODEL))  # the core call's
    only = [arg for name in FULL_SMOKE_STEPS for arg in ("--only", name)]
    return _Background(folder, [str(out), "--device", "cpu", "--smoke", *only])


# Each background run: the test that reads it, and how it starts.
BACKGROUND = {
    "full": ("test_full_call_smoke_runs_its_steps_and_summarizes_them", _start_full_smoke),
    "dry": ("test_dry_run_builds_every_steps_engine_configuration_at_full_size", _start_dry_run),
    "dry-eager": ("test_dry_run_checks_the_enforce_eager_commands_a_renamed_flag_and_a_killed_step",
                  _start_eager_dry_run),
}


@pytest.fixture(scope="module", autouse=True)
def suite_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Background]]:
    """The dry runs of the tests selected in this session, started side by side as the
    module starts; whatever is still running when the module ends is stopped."""
    selected = {getattr(item, "originalname", item.name) for item in request.session.items
                if item.path == request.path}
    runs = {key: start(tmp_path_factory.mktemp(key))
            for key, (test, start) in BACKGROUND.items() if test in selected}
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.timeout(1500)
def test_core_smoke_runs_every_step_and_summarizes_a_killed_one(tmp_path: Path) -> None:
    """The core call end to end at tiny shapes, the throughput step killed once it has written
    its first figures: the steps after it still run, and the summary quotes what it measured."""
    out = tmp_path / "core"
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out), "--core", "--device", "cpu",
                             "--smoke"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        # Killed once the first engine (--enforce-eager) has measured its first decode figure,
        # well before the step's end (the graphs engine is still to start); the bench is
        # killed, not the suite, which sees the step end with 137, as at its limit.
        wait_for_figures(proc, out / "throughput.jsonl",
                         lambda rs: any(r["kind"] == "decode" for r in rs),
                         "the throughput step's first figure", timeout_s=300)
        subprocess.run(["pkill", "-KILL", "-f", f"bench.suite.gpu_throughput .*--output {out}/"],
                       check=True)
        stdout, stderr = proc.communicate(timeout=1300)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = _steps(out)
    assert list(steps) == CORE_STEPS
    assert steps["throughput"][0] == "137", steps  # killed (128 + SIGKILL)
    failed = {name: (out / f"{name}.log").read_text()[-2000:]
              for name, (rc, *_) in steps.items() if name != "throughput" and rc != "0"}
    assert not failed, failed
    assert proc.returncode == 1, stderr[-3000:]  # a killed step is a failed call

    # What the killed step had measured landed line by line, and the summary quotes it.
    assert not (out / "throughput.json").exists()
    records = [json.loads(line) for line in (out / "throughput.jsonl").read_text().splitlines()]
    assert records[0]["kind"] == "run" and "done" not in [r["kind"] for r in records]
    summary = (out / "summary.md").read_text()
    assert summary == stdout[stdout.index("# GPU suite"):]
    assert "| throughput | TIMED OUT" in summary and "(partial: step timed out)" in summary
    # The figure it had measured, from throughput.jsonl: the eager engine's decode at batch 1.
    assert re.search(r"\| decode \| 1 \| 1 \| - \| [0-9.]+ \|", summary)

    smoke = json.loads((out / "smoke.json").read_text())
    assert smoke["verdict"] == "no graphs on this device"  # a CPU: eager, and it served
    assert smoke["phases"][0]["tokens"] > 0
    assert json.loads((out / "ttft_model.json").read_text())
    _check_http_burst(out / "burst-http-2048")
    gaps = json.loads((out / "stream_gaps.json").read_text())
    assert [r["context"] for r in gaps["rows"]] == [16, 200]
    for heading in ("## Smoke", "## Throughput against the hardware bound", "## SLO burst",
                    "## First requests after startup"):
        assert heading in summary, heading


def _check_http_burst(folder: Path) -> None:
    results = json.loads((folder / "results.json").read_text())
    assert {r["policy"] for r in results["runs"]} == {"fcfs", "slo+mf-conservative-suspend"}
    for run in results["runs"]:  # the client's TTFT and the server's, side by side
        assert all(r["server_ttft_s"] is not None and r["ttft_s"] is not None
                   for r in run["requests"] if r["error"] is None)
    # The servers' logs, at info level, as they ran.
    assert "INFO" in (folder / "server.log").read_text()


@pytest.mark.timeout(300)
def test_an_interrupted_suite_still_writes_its_summary(tmp_path: Path) -> None:
    """SIGTERM to the suite mid-step: the step is stopped, its row says killed, and the EXIT
    trap writes the summary of what ran."""
    out = tmp_path / "core"
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out), "--core", "--device", "cpu",
                             "--smoke"], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            tsv = out / "steps.tsv"
            if tsv.exists() and "throughput\trunning" in tsv.read_text():
                break
            time.sleep(0.5)
        else:
            pytest.fail("the throughput step never started")
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = _steps(out)
    assert list(steps) == ["smoke", "throughput"]  # nothing started after the signal
    assert steps["smoke"][0] == "0" and steps["throughput"][0] == "killed"
    assert proc.returncode == 143
    summary = (out / "summary.md").read_text()
    assert summary == stdout[stdout.index("# GPU suite"):]
    assert "## Smoke" in summary and "killed" in summary
    # No process of the killed step outlives it.
    leftover = subprocess.run(["pgrep", "-f", f"--output {out}/throughput.json"],
                              capture_output=True, text=True)
    assert leftover.stdout.strip() == ""


@pytest.mark.timeout(1500)
def test_full_call_smoke_runs_its_steps_and_summarizes_them(
        suite_runs: dict[str, _Background]) -> None:
    run = suite_runs["full"]
    proc = run.result(timeout=1400)
    out = run.stdout.parent / "full"
    steps = _steps(out)
    assert list(steps) == FULL_SMOKE_STEPS  # no calibration: the core call's line serves
    failed = {name: (out / f"{name}.log").read_text()[-2000:]
              for name, (rc, *_) in steps.items() if rc != "0"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-3000:]

    equality = json.loads((out / "equality.json").read_text())
    assert equality["passed"] and set(equality["archs"]) == {"llama", "qwen2"}
    for scenarios in equality["archs"].values():
        assert scenarios["cramped_pool"]["probe"]["kv_preemptions"] > 0
        assert scenarios["urgent_mid_prefill"]["probe"]["slo_preemptions"] >= 1
    throughput = json.loads((out / "throughput-hf.json").read_text())
    assert throughput["engine"]["mixed"]["steps_measured"] > 0
    # The bench asserts that every constrained request ran to its limit (a refused token
    # fails its request); its figures are real times, so positive.
    structured = json.loads((out / "structured.json").read_text())
    assert structured["batch"] == 4 and structured["device"] == "cpu"
    assert structured["constrained_tpot_ms"] > 0 and structured["bitmask_fill_ms_per_step"] > 0

    suite = json.loads((out / "suite.json").read_text())
    assert set(suite["steps"]) == set(FULL_SMOKE_STEPS)
    for key in ("equality", "structured", "kernels", "preempt_latency"):
        assert suite[key], key
    # Two sizes on one engine: the long prompt and the smallest preemptible step (128 tokens);
    # no graphs on the CPU, so both ran eager.
    latency = suite["preempt_latency"]
    assert [size["prompt_tokens"] for size in latency["sizes"]] == [400, 128]
    for size in latency["sizes"]:
        assert size["trials"] == 3 and len(size["long_step_ms"]) == 3
        assert size["long_step_ran_as"] == "eager" and size["unwinds_between_pieces"] == 0
    assert suite["kernels"]["tables"] and suite["kernels"]["smoke"]
    assert all(suite["tests"].values())  # each pytest step printed its totals

    summary = (out / "summary.md").read_text()
    assert summary == proc.stdout[proc.stdout.index("# GPU suite"):]
    for heading in ("## GPU tests", "## Greedy equality against HF transformers",
                    "## Structured outputs", "## Throughput against HF transformers", "## Kernels",
                    "## Preemption latency", "## SLO burst"):
        assert heading in summary, heading
    assert "FAILED" not in summary and "TIMED OUT" not in summary
    assert "| llama | urgent_mid_prefill | 2/2 |" in summary
    assert "| 400 | eager | 0 |" in summary and "| 128 | eager | 0 |" in summary
    # The in-process burst calibrated its own TTFT line (each size once in a smoke run).
    assert json.loads((out / "burst-inprocess" / "ttft_model.json").read_text())


@pytest.mark.timeout(400)
def test_dry_run_builds_every_steps_engine_configuration_at_full_size(
        suite_runs: dict[str, _Background]) -> None:
    run = suite_runs["dry"]
    proc = run.result(timeout=380)
    out = run.stdout.parent / "dry"
    steps = _steps(out)
    # A dry calibration writes no TTFT line, so the full call's unchunked burst calibrates
    # again (its row replaces the core call's).
    assert list(steps) == CORE_STEPS + FULL_STEPS
    failed = {name: _last_line(out, name) for name, (rc, *_) in steps.items() if rc != "0"}
    assert not failed, failed
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each step's command as the suite printed it: every one but the pytest steps runs through
    # the dry run's launcher (the product's entry points know nothing of a dry run).
    commands = dict(re.findall(r"^== ([a-z0-9-]+) \(limit \d+s\): (.*)$", proc.stdout,
                               flags=re.MULTILINE))
    assert set(commands) == set(steps)
    for name, command in commands.items():
        assert ("-m bench.suite.dry_run " in command) == (name not in TEST_STEPS), command
    for name in steps:
        last = _last_line(out, name)
        if name in TEST_STEPS:
            assert re.search(r"\d+ tests collected", last), (name, last)
        elif name == "kernels":
            assert last.startswith("dry run: arguments parsed: the kernels at full sizes"), last
        else:
            # The GPU's command line, not a smoke size: the 8B shape on CUDA.
            assert last.startswith("dry run: engine configuration built:"), (name, last)
            assert "device cuda" in last and "enforce_eager False" in last, (name, last)
            if name == "smoke":
                assert "model-llama-3.1-8b-2-layers (2 layers)" in last, last
            elif name != "equality":  # equality runs float32 models of its own
                assert "(32 layers)" in last and "load format dummy" in last, (name, last)
    assert "budget 32768 tokens" in _last_line(out, "calibrate")
    # Unchunked: a budget larger than any prompt, not the chunked run's.
    assert "budget 2048 tokens" in _last_line(out, "burst-http-2048")
    assert "budget 131072 tokens" in _last_line(out, "burst-http-unchunked")
    summary = (out / "summary.md").read_text()
    assert "dry run" in summary.lower()


@pytest.mark.timeout(200)
def test_dry_run_checks_the_enforce_eager_commands_a_renamed_flag_and_a_killed_step(
        suite_runs: dict[str, _Background]) -> None:
    """The core call's commands after a failed graph capture (every engine --enforce-eager),
    run from a copy of the script with one flag misspelt and one step's limit cut to a second
    (no Python with torch starts that fast), with --only the steps those touch
    (`_start_eager_dry_run`). The probe for the dry run: the misspelt flag fails exactly its
    step. The killed step does not stop the steps after it, and the summary says so."""
    run = suite_runs["dry-eager"]
    proc = run.result(timeout=180)
    out = run.stdout.parent / "dry-eager"
    steps = _steps(out)
    assert list(steps) == EAGER_PROBE_STEPS  # --only: those steps, in the call's order
    assert steps["throughput"][0] == "2"  # argparse: unrecognized arguments
    assert "unrecognized arguments: --eager-batch-sizes" in (out / "throughput.log").read_text()
    assert steps["calibrate"][0] == "124"  # timeout's status for a step it stopped
    assert all(rc == "0" for name, (rc, *_) in steps.items()
               if name not in ("throughput", "calibrate")), steps
    assert proc.returncode == 1
    for name in ("burst-http-2048", "stream-gaps"):
        assert "enforce_eager True" in _last_line(out, name), name
    assert "--assume-capture-failed" in (out / "notes.txt").read_text()
    summary = (out / "summary.md").read_text()
    assert "| calibrate | TIMED OUT" in summary and "| throughput | FAILED (exit 2)" in summary


def test_gpu_suite_refuses_the_full_shapes_without_a_gpu(tmp_path: Path) -> None:
    proc = _run([str(tmp_path), "--device", "cpu"], timeout=60)
    assert proc.returncode == 2 and "pass --smoke" in proc.stderr
    assert not (tmp_path / "steps.tsv").exists()  # nothing ran


def test_gpu_suite_needs_an_output_folder() -> None:
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_each_call_runs_its_steps_in_order_of_value_under_its_deadline() -> None:
    """The script's calls hold the steps this file expects, in that order, and the header
    states the deadlines the script uses."""
    script = SCRIPT.read_text()
    core = script[script.index("run_core() {"):script.index("run_full() {")]
    full = script[script.index("run_full() {"):script.rindex("case $call in")]
    names = re.compile(r'^\s*(?:step ([a-z0-9-]+)|burst_http ([a-z0-9]+))', flags=re.MULTILINE)

    def steps_of(body: str) -> list[str]:
        return [step or f"burst-http-{budget}" for step, budget in names.findall(body)]

    assert steps_of(core) == CORE_STEPS
    # The full call calibrates only where the core call's TTFT line is not in OUT.
    assert [n for n in dict.fromkeys(steps_of(full)) if n != "calibrate"] == FULL_STEPS
    deadlines = dict(re.findall(r"^\s*(core|full)\) deadline_s=\$\(\((\d+) \*", script,
                                flags=re.MULTILINE))
    stated = re.search(r"core (\d+) s, full (\d+) s", script)
    assert stated is not None
    assert (deadlines["core"], deadlines["full"]) == stated.groups()
    # The core call fits the tool's 10-minute command with its wheels and its summary, and
    # start + core + full fits 15 minutes of device time (CONTRIBUTING.md, GPU tests).
    assert int(deadlines["core"]) <= 360 and 180 + int(deadlines["core"]) + 30 \
        + int(deadlines["full"]) + 30 <= 900
    assert shutil.which("timeout")
