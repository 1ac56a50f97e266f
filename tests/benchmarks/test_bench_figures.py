"""engine/benchmarks/measure/figures.py: a JSON line per figure, readable while the writer runs and after
it was
killed mid-line."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from engine.benchmarks.measure.figures import FigureLog, jsonl_twin, read_figures


def test_each_record_is_on_disk_as_soon_as_it_is_written(tmp_path: Path) -> None:
    path = jsonl_twin(tmp_path / "sub" / "throughput.json")
    assert path == tmp_path / "sub" / "throughput.jsonl"

    @dataclasses.dataclass
    class Report:
        capture_s: float

    log = FigureLog(path)
    log.write("decode", batch=1, tpot_ms=7.5, bound={"tpot_ms": math.nan}, report=Report(2.0))
    # Read by another open while the writer's file is still open: flushed, not buffered.
    assert read_figures(path) == [{"kind": "decode", "batch": 1, "tpot_ms": 7.5,
                                   "bound": {"tpot_ms": None}, "report": {"capture_s": 2.0}}]
    log.write("done")
    log.close()
    assert [r["kind"] for r in read_figures(path)] == ["decode", "done"]
    # Standard JSON: no NaN in the file.
    assert all(json.loads(line, parse_constant=lambda c: 1 / 0) for line in
               path.read_text().splitlines())


def test_a_new_log_starts_afresh_and_none_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    with FigureLog(path) as log:
        log.write("a")
    with FigureLog(path) as log:
        log.write("b")
    assert [r["kind"] for r in read_figures(path)] == ["b"]
    FigureLog(None).write("ignored", value=1)  # no file asked for: a no-op
    assert read_figures(tmp_path / "missing.jsonl") == []


def test_a_line_cut_short_by_a_kill_is_left_out(tmp_path: Path) -> None:
    path = tmp_path / "cut.jsonl"
    path.write_text('{"kind": "trial", "ms": 1.5}\n{"kind": "trial", "ms": 2.5}\n{"kind": "tr')
    assert read_figures(path) == [{"kind": "trial", "ms": 1.5}, {"kind": "trial", "ms": 2.5}]
