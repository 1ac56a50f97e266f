"""`sloserve bench throughput|latency|serve|soak`, the standing end-to-end benchmarks as
subcommands of the one `bench` parser (engine/benchmarks/cli.py): each is listed and parses, and
`serve` writes its figures (its server and engine stood in for: a real run takes ~30 s here).
Throughput, latency and soak run end to end in their own files: test_bench_throughput,
test_bench_preempt_latency, test_bench_soak."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.entrypoints.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("throughput", "latency", "serve", "soak")


def test_bench_lists_and_dispatches_each_standing_benchmark() -> None:
    from engine.benchmarks.e2e import latency, serve_overhead, soak, throughput

    parser = build_parser()
    runs = {"throughput": throughput.run, "latency": latency.run, "serve": serve_overhead.run,
            "soak": soak.run}
    for name in COMMANDS:
        args = parser.parse_args(["bench", name, "--output", "figures.json"])
        assert args.func is runs[name] and args.output == "figures.json"
    assert parser.parse_args(["bench", "latency", "--simulate", "h100-llama-3.1-8b"]).simulate
    assert parser.parse_args(["bench", "throughput", "--random-heads", "8", "2"]).random_heads \
        == [8, 2]


def test_bench_throughput_with_device_runs_the_device_benchmark() -> None:
    """`--device` selects the device benchmark (its own options: --shape, --smoke, ...); without
    it, the HF comparison as before, which lists --device in its help."""
    from engine.benchmarks.e2e import throughput
    from engine.benchmarks.device_throughput import benchmark

    parser = build_parser()
    args = parser.parse_args(["bench", "throughput", "--device", "cuda", "--shape",
                              "llama-3.1-8b", "--no-hf", "--output", "t.json"])
    assert args.func is benchmark.run and args.shape == "llama-3.1-8b" and args.no_hf
    assert parser.parse_args(["bench", "throughput", "--device=cpu", "--smoke"]).smoke
    assert parser.parse_args(["bench", "throughput", "--quick"]).func is throughput.run


def test_the_cli_loads_a_standing_benchmark_only_when_it_is_parsed() -> None:
    """Every `sloserve` command builds the bench parser: it must not import torch, the engine or
    httpx for benchmarks nobody asked for."""
    probe = ("import sys; from engine.entrypoints.cli import build_parser; p = build_parser(); "
             "heavy = ('torch', 'httpx', 'engine.runtime.engine_core', "
             "'engine.benchmarks.e2e.throughput', 'engine.benchmarks.e2e.soak', "
             "'engine.benchmarks.device_throughput.benchmark'); "
             "print(sorted(m for m in heavy if m in sys.modules)); "
             "p.parse_args(['bench', 'soak', '--clients', '1']); "
             "print('engine.benchmarks.e2e.soak' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[:2] == ["[]", "True"]


def test_soak_passes_what_follows_the_double_dash_to_the_server() -> None:
    args = build_parser().parse_args(["bench", "soak", "--clients", "2", "--", "--dtype",
                                      "float32", "--num-kv-blocks", "128"])
    assert args.clients == 2 and args.server_args == ["--dtype", "float32", "--num-kv-blocks",
                                                      "128"]


def test_bench_help_names_the_standing_benchmarks() -> None:
    run = subprocess.run([sys.executable, "-m", "engine.entrypoints.cli", "bench", "--help"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    for name in COMMANDS:
        assert f"  {name} " in run.stdout, name


def test_bench_serve_help() -> None:
    # A real run starts a server and an engine: ~30 s here, too long for the suite.
    run = subprocess.run([sys.executable, "-m", "engine.entrypoints.cli", "bench", "serve",
                          "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--output PATH" in run.stdout, run.stderr[-2000:]


def test_bench_serve_writes_its_figures_to_output(tiny_model, tmp_path, monkeypatch,
                                                  capsys) -> None:
    """`run` with the server and the measurement stood in for: the JSON it prints and writes."""
    from contextlib import contextmanager
    from types import SimpleNamespace

    from engine.benchmarks.e2e import serve_overhead

    @contextmanager
    def no_server(argv):
        yield SimpleNamespace(url="http://127.0.0.1:1", process=SimpleNamespace(pid=1))

    measured = {"offline_latencies": [0.010, 0.020], "http_latencies": [0.012, 0.026],
                "offline_tokens_per_s": 100.0, "http_tokens_per_s": 80.0,
                "http_batch_seconds": 0.5, "http_batch_cpu_seconds": {"api_server": 0.1},
                "engine_steps_per_batch": {"offline": 2.0, "http": 3.0}}
    seen = {}

    def fake_measure(model, dtype, url, prompts, max_tokens, rounds, sequential, pid):
        seen.update(prompts=prompts, sequential=sequential)
        return measured

    monkeypatch.setattr(serve_overhead, "launched_server", no_server)
    monkeypatch.setattr(serve_overhead, "measure", fake_measure)
    output = tmp_path / "serve.json"
    args = build_parser().parse_args(["bench", "serve", "--model", tiny_model("llama"),
                                      "--requests", "2", "--prompt-len", "8",
                                      "--output", str(output)])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(output.read_text()) == result
    assert [len(p) for p in seen["prompts"]] == [8, 8] and seen["sequential"] == 2
    latency = result["sequential_latency_ms"]
    assert round(latency["overhead_median"], 6) == 4.0  # (2 ms + 6 ms) / 2
    assert round(result["concurrent_tokens_per_s"]["http_loss_pct"], 6) == 20.0
