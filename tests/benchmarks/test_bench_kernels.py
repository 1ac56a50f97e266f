"""The GPU kernel benchmark (bench/kernels/, `python -m bench.kernels.gpu_kernels`), without a
GPU: the plain run must exit cleanly with its needs-a-GPU line, `--smoke` (tiny shapes in
Triton's interpreter) must run every section and print its table rows, so the script cannot rot
untested, and under the GPU suite's dry run it stops once its arguments are parsed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The script must set the interpreter up itself (this process may have set it for others).
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "bench.kernels.gpu_kernels", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def _section(stdout: str, title: str) -> list[list[str]]:
    """The data rows (cells) of the table whose title line starts with `title`."""
    blocks = stdout.split("\n\n")
    block = next(b for b in blocks if b.startswith(title))
    lines = block.splitlines()
    return [line.split() for line in lines[2:] if re.match(r"\s*\d", line)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="would run the real benchmark")
def test_cpu_run_says_it_needs_a_gpu():
    result = _run()
    assert result.returncode == 0, result.stderr
    assert "needs an NVIDIA GPU" in result.stdout
    assert "tests/kernels/test_triton_kernels.py" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1


def test_smoke_run_prints_every_table():
    result = _run("--smoke")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("SMOKE RUN") and "NOT measurements" in out
    assert out.rstrip().endswith("only show that the script's code paths run.")
    # 2 batches x 2 contexts, 2 chunks x 2 prefixes: every row timed, none skipped.
    decode = _section(out, "decode:")
    prefill = _section(out, "prefill:")
    assert [(r[0], r[1]) for r in decode] == [("1", "40"), ("1", "100"), ("3", "40"),
                                              ("3", "100")]
    assert [(r[0], r[1]) for r in prefill] == [("8", "0"), ("8", "40"), ("24", "0"),
                                               ("24", "40")]
    for row in decode + prefill:
        assert row[4].endswith("x") and float(row[2]) > 0 and float(row[3]) > 0, row
    # The long-context verdicts are printed per row and summed up.
    assert [r[-1] for r in decode] == ["-", decode[1][-1], "-", decode[3][-1]]
    assert {decode[1][-1], decode[3][-1]} <= {"met", "MISSED"}
    assert "target: decode at context >= 100" in out
    assert "SDPA time excludes gathering" in out
    # The shorter context under the longer one's split plan (forced to 2 splits on the CPU).
    graph_plan = _section(out, "graph-plan decode:")
    assert [(r[0], r[1], r[2]) for r in graph_plan] == [("1", "40", "2"), ("3", "40", "2")]
    for row in graph_plan:
        assert row[6].endswith("x") and all(float(c) > 0 for c in row[3:6]), row
    # Triton and the PyTorch baselines agree, so the bench's layouts are right.
    assert "WARNING" not in out
    for module, title in (("triton_norm", "rms_norm:"), ("triton_rotary", "rotary:"),
                          ("triton_activation", "silu_and_mul:")):
        if (REPO / "kernels" / f"{module}.py").exists():
            assert _section(out, title), f"no {title} rows"
        else:
            assert f"kernels.{module} not found" in out


def _block(stdout: str, title: str) -> list[list[str]]:
    """The rows (cells) of the table whose title line starts with `title`, header excluded."""
    block = next(b for b in stdout.split("\n\n") if b.startswith(title))
    return [line.split() for line in block.splitlines()[2:] if line.strip()]


def test_smoke_sweep_runs_every_config_and_prints_the_choice(tmp_path):
    """``--sweep-configs --smoke``: the sweep's code path in the interpreter, two configs per
    kind on one tiny shape each, ending with the chosen config as a literal that builds."""
    path = tmp_path / "sweep.json"
    result = _run("--smoke", "--sweep-configs", "--output", str(path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("SMOKE RUN") and "WARNING" not in out and "STOPPED" not in out
    assert "sweep: 4 configs (2 decode, 2 prefill)" in out
    decode = _block(out, "decode sweep:")
    prefill = _block(out, "prefill sweep:")
    assert [r[0] for r in decode] == ["t32w4s3", "t64w4s2"]
    assert [r[0] for r in prefill] == ["m64t64w4s3", "m128t32w8s3"]
    for row in decode + prefill:
        assert row[-1] == "ok" and row[1].endswith("x") and "/" in row[1], row
    assert [r[0] for r in _block(out, "decode: the best config per shape")] == ["2x100"]
    assert [r[0] for r in _block(out, "prefill: the best config per shape")] == ["24+40"]
    assert "decode: best over all shapes" in out and "prefill: best over all shapes" in out
    # The literal builds one of the swept configs.
    from kernels import triton_attention

    literal = out.split("DEFAULT_ATTENTION_CONFIG = ", 1)[1].split("\n\n")[0].split("\n(")[0]
    chosen = eval(literal, vars(triton_attention))  # noqa: S307 - the script's own literal
    assert chosen.decode.tile_n in (32, 64) and chosen.prefill.block_m in (64, 128)
    sweep = json.loads(path.read_text())["sweep"]
    assert (sweep["configs_run"], sweep["configs_queued"], sweep["stopped_early"]) \
        == (4, 4, False)
    assert eval(sweep["literal"], vars(triton_attention)) == chosen  # noqa: S307
    for kind, shape in (("decode", "2x100"), ("prefill", "24+40")):
        configs = sweep["kinds"][kind]["configs"]
        assert [c["status"] for c in configs] == ["ok", "ok"]
        assert all(set(c["shapes"]) == {shape} and c["shapes"][shape]["ratio"] > 0
                   for c in configs)


def test_sweep_until_s_starts_no_config_past_its_time(tmp_path):
    path = tmp_path / "sweep.json"
    result = _run("--smoke", "--sweep-configs", "--sweep-until-s", "0", "--sections", "decode",
                  "--output", str(path))
    assert result.returncode == 0, result.stderr
    assert "STOPPED: --sweep-until-s 0 reached after 0 of 2 configs" in result.stdout
    assert "decode: no config run" in result.stdout and "prefill sweep" not in result.stdout
    sweep = json.loads(path.read_text())["sweep"]
    # Probe: the limit stopped it (2 queued, none run), and the default stands.
    assert (sweep["configs_run"], sweep["configs_queued"], sweep["stopped_early"]) \
        == (0, 2, True)
    assert "(the same as the current default)" in result.stdout


def test_peak_bandwidth_sources(monkeypatch):
    from bench.kernels import harness as bench

    timer = bench.Timer(torch.device("cpu"), 0, 1)
    cuda = torch.device("cuda", 0)
    assert bench.peak_bandwidth(cuda, 123.0, timer) == (123.0, "from --peak-gbps")

    # A100 40GB as cudaGetDeviceProperties reports it: 1215 MHz HBM2 on a 5120-bit bus.
    a100 = SimpleNamespace(name="NVIDIA A100-SXM4-40GB", memory_clock_rate=1_215_000,
                           memory_bus_width=5120)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: a100)
    gbps, source = bench.peak_bandwidth(cuda, None, timer)
    assert gbps == pytest.approx(1555.2) and "device properties" in source

    # No clock reported: the datasheet table by name.
    h100 = SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=0, memory_bus_width=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h100)
    assert bench.peak_bandwidth(cuda, None, timer) == (
        3350, "datasheet value for H100 SXM (matched by device name)")

    names = {"NVIDIA A100 80GB PCIe": 1935, "NVIDIA A100-SXM4-80GB": 2039,
             "NVIDIA A100-PCIE-40GB": 1555, "NVIDIA H100 PCIe": 2000, "NVIDIA L4": 300,
             "NVIDIA L40S": 864, "NVIDIA A10": 600, "NVIDIA A10G": 600,
             "NVIDIA GeForce RTX 4090": 1008, "Tesla T4": 320}
    for name, expected in names.items():
        assert bench.datasheet_gbps(name)[0] == expected, name
    assert bench.datasheet_gbps("Some Future GPU") is None


def test_prefill_baseline_falls_back_to_repeated_kv(monkeypatch):
    """Where SDPA rejects grouped K/V under a lower-right causal bias, the baseline repeats K/V
    to the query heads (query head h reads KV head h // group) and still computes the same."""
    from torch.nn.attention.bias import causal_lower_right

    from bench.kernels import gpu_kernels as bench

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g)
    k, v = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
        attn_mask=causal_lower_right(5, 12).to_dense())
    call, mask = bench.sdpa_prefill(q, k, v, prefix=7, scale=16 ** -0.5)
    assert mask == "lower-right" and torch.allclose(call(), expected, atol=1e-5)

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def no_gqa_with_bias(*args, attn_mask=None, enable_gqa=False, **kwargs):
        if enable_gqa and attn_mask is not None:
            raise RuntimeError("grouped K/V not supported with this mask")
        return sdpa(*args, attn_mask=attn_mask, enable_gqa=enable_gqa, **kwargs)

    # The bench's own F only: CausalBias dispatches on torch's function being the real one.
    monkeypatch.setattr(bench, "F", SimpleNamespace(scaled_dot_product_attention=no_gqa_with_bias))
    call, mask = bench.sdpa_prefill(q, k, v, prefix=7, scale=16 ** -0.5)
    assert mask == "lower-right, K/V repeated" and torch.allclose(call(), expected, atol=1e-5)


def test_one_section_writes_its_table_to_output(tmp_path):
    """A --smoke run of one section prints its table and writes it to --output."""
    path = tmp_path / "kernels.json"
    result = _run("--smoke", "--sections", "silu", "--output", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("SMOKE RUN")
    assert [(r[0], r[1]) for r in _section(result.stdout, "silu_and_mul:")] == [("1", "96"),
                                                                                ("5", "96")]
    written = json.loads(path.read_text())
    assert written["smoke"] and [t["title"].split(":")[0] for t in written["tables"]] \
        == ["silu_and_mul"]


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    """The benchmark through the GPU suite's dry-run launcher (bench/suite/dry_run.py)."""
    from bench.suite import dry_run

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop(dry_run.DRY_RUN_ENV, None)  # the launcher is the switch
    return subprocess.run([sys.executable, "-m", "bench.suite.dry_run", "bench.kernels.gpu_kernels",
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, what", [
    ((), "the kernels at full sizes, 20 repeats"),
    (("--sweep-configs", "--sweep-until-s", "480"),
     "the attention launch-config sweep at full sizes, 20 repeats")])
def test_a_dry_run_stops_once_the_arguments_are_parsed(tmp_path, args, what):
    """It builds no engine: under the suite's dry run it says what would have run and exits 0
    before any kernel, table or file; a misspelt flag still fails."""
    path = tmp_path / "out.json"
    result = _dry_run(*args, "--output", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"dry run: arguments parsed: {what}"
    assert result.stdout == "" and not path.exists()
    misspelt = _dry_run(*args, "--rounds", "3")
    assert misspelt.returncode == 2 and "unrecognized arguments: --rounds" in misspelt.stderr
